"""One ledger of served grants per engine core, shared by its block servers (TCP and UCX): a
grant spent on some blocks cannot fetch them again from either server."""

from __future__ import annotations

import pytest

from pdmesh.kvstore.connector.exports import Export, ExportRegistry
from pdmesh.kvstore.connector.grant_ledger import GrantLedger, GrantRefused

pytestmark = pytest.mark.fast


def ledger_with(block_ids: tuple[int, ...]) -> tuple[GrantLedger, ExportRegistry]:
    exports = ExportRegistry()
    exports.add(Export("r1", block_ids, 16 * len(block_ids)))
    return GrantLedger(exports), exports


def test_each_block_is_served_once_per_grant_whoever_asks() -> None:
    ledger, _ = ledger_with((7, 8, 9, 10))
    assert ledger.admit("r1", "g", 0, 2) == (7, 8)
    with pytest.raises(GrantRefused, match="already served"):
        ledger.admit("r1", "g", 1, 2)  # block 1 again, e.g. through the other server
    assert ledger.admit("r1", "g", 2, 2) == (9, 10)
    assert ledger.admit("r1", "another grant", 0, 4) == (7, 8, 9, 10)


def test_a_streamed_export_serves_only_its_ready_blocks_and_then_the_next() -> None:
    ledger, exports = ledger_with((3,))
    with pytest.raises(GrantRefused, match="outside"):
        ledger.admit("r1", "g", 0, 2)
    exports.extend("r1", [4])
    assert ledger.admit("r1", "g", 0, 2) == (3, 4)


def test_no_export_no_blocks_and_a_new_export_under_the_same_id_starts_afresh() -> None:
    ledger, exports = ledger_with((1, 2))
    assert ledger.admit("r1", "g", 0, 2) == (1, 2)
    exports.remove("r1")
    with pytest.raises(GrantRefused, match="no export"):
        ledger.admit("r1", "g", 0, 1)
    exports.add(Export("r1", (5, 6), 32))
    assert ledger.admit("r1", "g", 0, 2) == (5, 6)
