"""KV-cache transfer from prefill to decode: lease-held, pulled, verified, acknowledged.

Public API, by module (the package imports nothing itself, so a process that needs only the
control-plane types, such as the router's capabilities, does not load torch with the data
planes):

* `sender.KVSender` / `KVSenderConfig` (prefill side): `publish(request_id, kv, num_tokens)` ->
  `KVHandle`; `on_release(request_id, ReleaseReason)` fires exactly once per publish.
* `receiver.KVReceiver` / `KVReceiverConfig` (decode side): `await fetch(handle, deadline)`.
* `handle.KVHandle`, `layout.KVLayout`: what crosses the router (`to_proto`/`from_proto`,
  `to_dict`/`from_dict`).
* `state.TransferState`, `state.ReleaseReason`, `deadline.Deadline`, and the
  `errors.KVTransferError` family; `capability.TransferCapability`.

Data planes (`backends/`): shm (same host, default there), tcp, ucxx (optional package),
torch_dist (gloo/NCCL). Wire format: `wire.py`. Lease rules: `lease.py`.
"""
