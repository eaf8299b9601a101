"""The GPU path checked in one prepared run on a lent device (gpu_check.py, run as a script with a
plain python and no install), and its checks, one module each; at tiny sizes on CPU in CI."""
