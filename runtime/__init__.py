"""splitserve replica runtime: what hosts an engine in a replica process -- the Ray actor base
both workers share (EngineWorker), a replica's end of the request channel and its pushed-state
publisher. Below prefill/ and decode/ (which never import each other), above kvtransfer/ and
engine/: the engine itself knows nothing of actors, channels or subscribers."""
