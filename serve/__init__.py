"""`pdmesh serve`: a whole mesh on this machine, as supervised child processes.

`config.py` is its settings (`MeshConfig`), `child_config.py` what each child is told (its
config, rendered as flags), `child.py` a child process, `supervisor.py` restarting the ones
that die, `mesh.py` the mesh (`LocalMesh`, also the tests' harness), `command.py` the command.
"""

from pdmesh.serve.child import Child, ChildFailed, Endpoint, pdmesh_command
from pdmesh.serve.config import MeshConfig
from pdmesh.serve.mesh import API_KEY_ENV, DRAIN_ENV, LocalMesh

__all__ = [
    "API_KEY_ENV", "DRAIN_ENV", "Child", "ChildFailed", "Endpoint", "LocalMesh", "MeshConfig",
    "pdmesh_command",
]
