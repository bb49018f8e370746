"""The KV data planes' names, torch-free: the configs that offer them as flag choices are parsed
by `pdmesh serve` and the router, which never import torch (handle.py, which checks them, does)."""

BACKEND_NAMES = ("shm", "tcp", "ucxx", "torch_dist")
