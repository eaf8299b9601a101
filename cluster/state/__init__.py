"""The state store: what must outlive every process (batch files and jobs, tenant usage).

SQLite in WAL mode under `ServeConfig.state_dir` by default, Postgres (psycopg) by
`ServeConfig.state_url`; one SQLAlchemy schema for both (`schema.py`), opened by `database.py`.
"""
