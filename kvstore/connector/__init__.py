"""The KV connector: the engine core's own end of KV transfer (the worker side).

The process that owns the KV cache moves its blocks itself, straight from and into the cache
tensor; the serving process keeps the control plane (`kvstore/transfer/`: leases, capabilities,
gRPC, metrics, traces) and never touches KV bytes. Modules: `blocks.py` (block runs, copies,
per-block checksums), `config.py`, `source.py` (what a load is told), `cache_file.py` (a CPU
cache a peer core on the host can map) and `cuda_ipc.py` (its GPU form, mapped through
`cuda_driver.py`), `exports.py` (what
the core lends; `export_info.py`, what the serving process publishes of it), `grant_mac.py`
(the serving process's word that a pull was granted) and `grant_ledger.py` (each block
once per grant, across the core's block servers), one module per transport
(`shm_peer.py`, `tcp_blocks.py`, `dist_blocks.py`, `ucx_blocks.py`), and `connector.py`, the
core's façade.
The serving process imports only the torch-free ones (`config.py`, `source.py`,
`export_info.py`, `grant_mac.py`).

The package imports nothing itself: import from its modules.
"""
