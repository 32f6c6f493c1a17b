"""Plant known bugs in a copy of the package and check that the tests catch each one.

Each mutant is an exact text substitution in a temporary copy of ``src/``. The tests that
should catch it run against that copy (``PYTHONPATH`` points at it); a mutant is *killed*
when they fail, and *survives* when they pass. An anchor text that is not found exactly once
stops the run before any test runs, so a mutant cannot silently stop applying: update the
anchor to the current code.

    python tools/mutants.py                 # every mutant, each against its own tests
    python tools/mutants.py lock-removed    # one mutant
    python tools/mutants.py --full          # every mutant against all of tests/
    python tools/mutants.py --list          # the mutants and their tests

Exit status: 0 when every mutant was killed, 1 when one survived, 2 when a mutant could not
be applied or its tests could not run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    description: str
    path: str  # relative to src/
    substitutions: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]  # relative to the repository root


MUTANTS = (
    Mutant(
        "lock-removed",
        "the manager's lock is a no-op",
        "sessionstate/_manager/_table.py",
        (
            (
                "self.lock = _Lock(threading.RLock(), self.reporter)",
                'self.lock = __import__("contextlib").nullcontext()',
            ),
        ),
        ("tests/manager/test_manager_threads.py",),
    ),
    Mutant(
        "tree-equal-allclose",
        "tree_equal compares floating tensors with allclose",
        "sessionstate/_tree.py",
        (
            (
                "    return torch.equal(_bits(x), _bits(y))",
                "    if x.is_floating_point():\n"
                "        return bool(torch.allclose(x, y, equal_nan=True))\n"
                "    return torch.equal(_bits(x), _bits(y))",
            ),
        ),
        ("tests/core/test_tree_bitwise.py",),
    ),
    Mutant(
        "put-stores-before-validating",
        "put stores the record before checking it",
        "sessionstate/_manager/_access.py",
        (
            (
                "    check_state(state, session_id)\n",
                "    t.records[session_id] = state\n    check_state(state, session_id)\n",
            ),
        ),
        ("tests/manager/test_manager.py",),
    ),
    Mutant(
        "ring-keeps-one-too-many",
        "a ring of maxlen k keeps k + 1 chunks",
        "sessionstate/_objects.py",
        (
            (
                "if maxlen is not None and len(joined) > maxlen:\n"
                "            joined = joined[len(joined) - maxlen :]",
                "if maxlen is not None and len(joined) > maxlen + 1:\n"
                "            joined = joined[len(joined) - maxlen - 1 :]",
            ),
            (
                "if maxlen is not None and len(out) > maxlen:\n"
                "        out = out.drop_front(len(out) - maxlen)",
                "if maxlen is not None and len(out) > maxlen + 1:\n"
                "        out = out.drop_front(len(out) - maxlen - 1)",
            ),
            (
                "if self.maxlen is not None and len(self.chunks) > self.maxlen:",
                "if self.maxlen is not None and len(self.chunks) > self.maxlen + 1:",
            ),
        ),
        ("tests/core/test_objects_stateful.py", "tests/core/test_objects.py"),
    ),
    Mutant(
        "chunk-block-index-off-by-one",
        "a buffer's chunk past its first block is read from the block before",
        "sessionstate/_objects.py",
        (("return self._blocks[block + 1][offset]", "return self._blocks[block][offset]"),),
        ("tests/core/test_chunk_blocks.py",),
    ),
    Mutant(
        "chunk-blocks-sealed-short",
        "a buffer seals a block one chunk short, so later blocks are not full",
        "sessionstate/_objects.py",
        (
            (
                "whole = len(items) - len(items) % _BLOCK\n"
                "        blocks = tuple(items[i : i + _BLOCK] for i in range(0, whole, _BLOCK))",
                "whole = len(items) - len(items) % (_BLOCK - 1)\n"
                "        blocks = tuple(\n"
                "            items[i : i + _BLOCK - 1] for i in range(0, whole, _BLOCK - 1)\n"
                "        )",
            ),
        ),
        ("tests/core/test_chunk_blocks.py",),
    ),
    Mutant(
        "commit-keeps-the-built-tuple",
        "a commit carries the previous buffer's built `chunks` tuple over to the new buffer",
        "sessionstate/_objects.py",
        (
            (
                'object.__setattr__(new, "_seq", seq)  # `chunks` is built from it when read',
                'new.__dict__.update(self.__dict__)\n        object.__setattr__(new, "_seq", seq)',
            ),
        ),
        ("tests/core/test_chunk_blocks.py",),
    ),
    Mutant(
        "nbytes-by-numel",
        "a tensor counts numel * element_size, not its storage",
        "sessionstate/_accounting.py",
        (
            (
                "entry = (storage._cdata, virtual_address(storage), storage.nbytes(), storage)",
                "entry = (storage._cdata, virtual_address(storage), "
                "t.numel() * t.element_size(), storage)",
            ),
            (  # the ledger's walk of a changed leaf
                "(device, identity, storage.data_ptr() or (identity << 64), "
                "storage.nbytes(), storage)",
                "(device, identity, storage.data_ptr() or (identity << 64), "
                "leaf.numel() * leaf.element_size(), storage)",
            ),
            (  # nbytes_by_device's inline count
                "            nbytes = storage.nbytes()\n            if nbytes == 0:",
                "            nbytes = leaf.numel() * leaf.element_size()\n"
                "            if nbytes == 0:",
            ),
        ),
        ("tests/manager/test_manager_stateful.py", "tests/manager/test_manager_threads.py"),
    ),
    Mutant(
        "dedup-by-data-pointer",
        "storages are told apart by data pointer only",
        "sessionstate/_accounting.py",
        (
            (
                "entry = (storage._cdata, virtual_address(storage), storage.nbytes(), storage)",
                "entry = (storage.data_ptr(), storage.data_ptr(), storage.nbytes(), storage)",
            ),
            (  # the ledger's walk of a changed leaf
                "        identity = storage._cdata\n        return [",
                "        identity = storage.data_ptr()\n        return [",
            ),
            (  # nbytes_by_device's inline count
                "            identity = storage._cdata\n            if identity in seen:",
                "            identity = storage.data_ptr()\n            if identity in seen:",
            ),
        ),
        ("tests/core/test_accounting.py", "tests/manager/test_manager_stateful.py"),
    ),
    # -- snapshot mutants (issue 21) --
    Mutant(
        "save-writes-in-place",
        "save_state writes straight into the target file instead of a partial file renamed",
        "sessionstate/_storage/_encode.py",
        (
            (
                "    try:\n"
                "        _write_file(partial, header, data, durable=durable)\n"
                "        os.replace(partial, target)\n"
                "    finally:\n"
                "        with contextlib.suppress(FileNotFoundError):\n"
                "            partial.unlink()\n",
                "    _write_file(target, header, data, durable=durable)\n",
            ),
        ),
        (
            "tests/storage/test_snapshot_hostile.py::"
            "test_a_save_failing_midway_leaves_the_previous_file_and_nothing_else",
        ),
    ),
    Mutant(
        "loads-skips-storage-crc",
        "a snapshot loaded from bytes (loads_state: restore, migration) skips the storage checksum",
        "sessionstate/_storage/_decode.py",
        (
            (
                "        if hasher.value() != described.checksum:",
                '        if source != "(bytes)" and hasher.value() != described.checksum:',
            ),
        ),
        (
            "tests/storage/test_snapshot_hostile.py::"
            "test_corrupt_storage_bytes_through_loads_state_give_snapshot_error",
        ),
    ),
    Mutant(
        "header-crc-skipped",
        "the loader never checks the checksum of a snapshot's JSON document",
        "sessionstate/_storage/_decode.py",
        (
            (
                "        if stored is not None and stored != kind.of_document(text):",
                "        if False:",
            ),
        ),
        (
            "tests/storage/test_snapshot_hostile.py::test_a_changed_value_in_the_header_fails_its_checksum",
            "tests/storage/test_snapshot_hostile.py::"
            "test_random_header_bit_flips_never_load_a_different_record",
        ),
    ),
    # -- distributed mutants (issue 21) --
    Mutant(
        "migration-import-skips-crc",
        "the loader skips the storage checksum for a snapshot in parts (the migration import path)",
        "sessionstate/_storage/_decode.py",
        (
            (
                "        if hasher.value() != described.checksum:",
                '        if source != "(parts)" and hasher.value() != described.checksum:',
            ),
        ),
        (
            "tests/distributed/test_distributed_faults.py::"
            "test_parts_corrupted_in_transit_fail_the_import_with_snapshot_error",
        ),
    ),
    Mutant(
        "parts-layout-unchecked",
        "a snapshot in parts is loaded without checking each part's size and offset",
        "sessionstate/_storage/_decode.py",
        (
            (
                "        if described.start != start or described.nbytes != len(view):",
                "        if False:",
            ),
        ),
        (
            "tests/storage/test_snapshot_parts.py::test_a_resized_part_is_refused",
            "tests/storage/test_snapshot_parts.py::"
            "test_a_signed_huge_storage_is_refused_before_anything_is_allocated",
        ),
    ),
    Mutant(
        "migration-ack-unchecked",
        "the router never compares the destination's digest with the source's",
        "sessionstate/distributed/_router.py",
        (("    if ack.digest != expected:", "    if False:"),),
        (
            "tests/distributed/test_distributed_faults.py::"
            "test_a_wrong_digest_fails_the_migration_at_the_acknowledge_stage",
        ),
    ),
    Mutant(
        "drop-to-placement",
        "the router sends drop to the placement choice instead of the owner",
        "sessionstate/distributed/_router.py",
        (
            (
                "self._handles[owner].drop_session.remote(session_id, epoch=epoch),",
                "self._handles[self._place()].drop_session.remote(session_id, epoch=epoch),",
            ),
        ),
        (
            "tests/distributed/test_distributed_faults.py::"
            "test_drops_reach_the_owner_and_leave_no_worker_holding_the_sessions",
        ),
    ),
    Mutant(
        "export-keeps-serving",
        "a worker keeps stepping a session it exported to a migration",
        "sessionstate/distributed/_worker.py",
        (("        self._handed_off.add(session_id)\n", ""),),
        ("tests/distributed/test_distributed_fencing.py",),
    ),
    Mutant(
        "worker-ignores-epochs",
        "a worker applies an operation whatever epoch it carries",
        "sessionstate/distributed/_worker.py",
        (
            (
                "        held = self._held(session_id)\n        if held == epoch and",
                "        held = epoch = self._held(session_id)\n        if held == epoch and",
            ),
        ),
        ("tests/distributed/test_distributed_fencing.py",),
    ),
    Mutant(
        "family-import-unshares",
        "a worker imports a migrated family as separate copies, its sharing lost",
        "sessionstate/distributed/_worker.py",
        (
            (
                "        records = decode_family(data)\n",
                "        records = [decode_record(encode_record(r))"
                " for r in decode_family(data)]\n",
            ),
        ),
        (
            "tests/distributed/test_distributed_family.py::"
            "test_a_dreamzero_family_migrates_as_one_payload_and_keeps_its_sharing",
        ),
    ),
    Mutant(
        "failed-migration-keeps-import",
        "a failed migration leaves the destination's imported copies in place",
        "sessionstate/distributed/_router.py",
        (
            (
                '            if stage != "export" and destination not in dead:',
                "            if False:",
            ),
        ),
        (
            "tests/distributed/test_distributed_family.py::"
            "test_a_failed_family_migration_leaves_every_session_on_the_source",
        ),
    ),
    Mutant(
        "sharing-counts-own-aliases",
        "stats()'s shared_sessions counts a session that reaches a storage only itself holds",
        "sessionstate/_manager/_decide.py",
        (
            (
                "return any(references.get(identity, 0) > n for identity, n in own.items())",
                "return any(references.get(identity, 0) >= n for identity, n in own.items())",
            ),
        ),
        (
            "tests/manager/test_decide.py",
            "tests/manager/test_observability.py::"
            "test_the_fork_metrics_equal_stats_as_a_family_grows_and_lets_go",
        ),
    ),
    Mutant(
        "batch-evicts-before-the-budget-check",
        "a batch the budget cannot hold evicts others before it is refused",
        "sessionstate/_manager/_decide.py",
        (("        if totals.get(device, 0) > nbytes:", "        if False:"),),
        (
            "tests/manager/test_decide.py",
            "tests/manager/test_fork.py::test_a_batch_the_budget_cannot_hold_evicts_nobody_first",
        ),
    ),
    Mutant(
        "put-walks-no-changed-value",
        "a put against the stored record's names walks none of the values that changed",
        "sessionstate/_manager/_ledger.py",
        (
            (
                "moved = map(operator.is_not, last.raw, raw)",
                "moved = itertools.repeat(False)",
            ),
        ),
        (
            "tests/manager/test_ledger_fast_paths.py::test_puts_by_what_changed_and_batches_equal_a_recount",
        ),
    ),
    Mutant(
        "ledger-moves-no-changed-key",
        "the ledger, moving by the changed keys alone, moves by none",
        "sessionstate/_manager/_ledger.py",
        (
            (
                "pairs = [(key, values[key]) for key in values.changed]",
                "pairs = []",
            ),
        ),
        (
            "tests/manager/test_ledger_fast_paths.py::test_puts_by_what_changed_and_batches_equal_a_recount",
        ),
    ),
    Mutant(
        "stored-values-keep-their-parent",
        "stored values keep the values they were walked against: every version stays alive",
        "sessionstate/_manager/_ledger.py",
        (("                values.parent = None", "                pass"),),
        (
            "tests/manager/test_ledger_fast_paths.py::test_a_stored_record_keeps_no_earlier_version_alive",
        ),
    ),
    Mutant(
        "refused-batch-keeps-its-ledger",
        "a batch of held sessions refused by the budget leaves the ledger moved",
        "sessionstate/_manager/_access.py",
        (
            (
                "        ledger.set_many(zip(ids, replaced, strict=True))\n"
                "        ledger.undo_growth(grown)\n",
                "        ledger.undo_growth(grown)\n",
            ),
        ),
        (
            "tests/manager/test_get_put_many.py::test_a_batch_of_held_sessions_over_the_budget_is_refused_whole",
        ),
    ),
    Mutant(
        "ring-backing-never-compacts",
        "a ring's ledger backing keeps 64 dropped chunks alive before it is copied",
        "sessionstate/_manager/_ledger.py",
        (
            (
                "if previous.stop == len(backing) and start <= len(leaves):",
                "if previous.stop == len(backing) and start <= 64 + len(leaves):",
            ),
        ),
        (
            "tests/manager/test_ledger_fast_paths.py::"
            "test_the_ledger_keeps_at_most_a_rings_worth_of_dropped_chunks_alive",
        ),
    ),
    Mutant(
        "refused-put-keeps-its-growth",
        "a put refused after its walk leaves its new chunks in the stored buffer's backing",
        "sessionstate/_manager/_access.py",
        (
            (
                "        t.ledger.undo_growth(grown)\n        t.parking.storing = ()",
                "        t.parking.storing = ()",
            ),
        ),
        (
            "tests/manager/test_ledger_fast_paths.py::"
            "test_a_refused_put_keeps_none_of_its_new_chunks_alive",
        ),
    ),
    Mutant(
        "refused-batch-keeps-its-growth",
        "a batch refused after its walk leaves its new chunks in the stored buffers' backings",
        "sessionstate/_manager/_access.py",
        (("        ledger.undo_growth(grown)\n        raise", "        raise"),),
        (
            "tests/manager/test_ledger_fast_paths.py::"
            "test_a_refused_put_keeps_none_of_its_new_chunks_alive",
        ),
    ),
    Mutant(
        "placement-ignores-room",
        "the router places a new session on a worker that reported no room",
        "sessionstate/distributed/_router.py",
        (
            (
                "roomy = [name for name in live if self._room.get(name, True)] or live",
                "roomy = live",
            ),
        ),
        ("tests/distributed/test_distributed_placement.py",),
    ),
    # -- manager, budget and guard mutants (issue 21) --
    Mutant(
        "ledger-misses-earlier-overlap",
        "the eager reference ledger misses a stored address range that starts before a new one",
        "sessionstate/testing/recount.py",
        (
            (
                "lo = bisect.bisect_left(spans, (start - self._longest, start - self._longest), "
                "0, at)",
                "lo = bisect.bisect_left(spans, (start, start), 0, at)",
            ),
        ),
        ("tests/manager/test_ledger_overlaps.py",),
    ),
    Mutant(
        "budget-refuses-by-table-total",
        "a put is refused when the whole table, not the record alone, is over a device's budget",
        "sessionstate/_manager/_policy.py",
        (
            (
                "            alone = ledger.session_total(session_id, device)",
                "            alone = ledger.total(device)",
            ),
        ),
        ("tests/manager/test_budget_incremental.py",),
    ),
    Mutant(
        "budget-checks-first-device-only",
        "the planner checks only the first device named in max_bytes",
        "sessionstate/_manager/_policy.py",
        (
            (
                "            for device, budget in self.max_bytes.items()\n"
                "            if ledger.total(device) + extra.get(device, 0) > budget",
                "            for device, budget in list(self.max_bytes.items())[:1]\n"
                "            if ledger.total(device) + extra.get(device, 0) > budget",
            ),
        ),
        ("tests/manager/test_budget_devices.py",),
    ),
    Mutant(
        "park-splits-alias-through-objects",
        "the budget parks an object sharing a storage with another object that stays resident "
        "because it shares one with an attribute (what stays is not closed over shared storages)",
        "sessionstate/_manager/_policy.py",
        (
            (
                "                    reached.add(key)\n                    staying.append(key)\n",
                "                    reached.add(key)\n",
            ),
        ),
        ("tests/storage/test_park.py",),
    ),
    Mutant(
        "guard-floating-point-only",
        "the guard records only floating-point tensors",
        "sessionstate/_manager/_guard.py",
        (
            (
                "            if version is not None:\n"
                "                versions.append((index, leaf, version))",
                "            if version is not None and leaf.is_floating_point():\n"
                "                versions.append((index, leaf, version))",
            ),
        ),
        ("tests/manager/test_guard_dtypes.py",),
    ),
    # -- model mutants (issue 21) --
    Mutant(
        "cosmos3-manager-without-budget",
        "Cosmos3's manager is built without the byte budget (the drift of issue 20)",
        "sessionstate/models/cosmos3/_managed.py",
        (
            (
                "super().__init__(model, settings, Cosmos3Session, unknown_session, lost=",
                'super().__init__(model, __import__("attrs").evolve(settings, max_bytes=None), '
                "Cosmos3Session, unknown_session, lost=",
            ),
        ),
        ("tests/models/test_two_model_contract.py",),
    ),
    Mutant(
        "rebalance-splits-families",
        "rebalance weighs and moves each session alone, parting a fork from what it shares",
        "sessionstate/distributed/_router.py",
        (
            (
                "            units = self._units(heavy, stats[heavy].nbytes_by_session)\n",
                "            units = {(k,): n for k, n in stats[heavy]"
                ".nbytes_by_session.items()}\n",
            ),
        ),
        ("tests/distributed/test_distributed_family.py",),
    ),
    Mutant(
        "stack-copies-each-view-alone",
        "stacking copies every view of a record's storage on its own: unstacked records lose "
        "their aliases",
        "sessionstate/_batch.py",
        (("    groups = _storage_groups(columns)\n", "    groups: list[list[int]] = []\n"),),
        ("tests/core/test_batch.py",),
    ),
    Mutant(
        "unstack-drops-new-kv-tokens",
        "unstacking a batch gives each record its gathered handle back, dropping the tokens "
        "its step appended",
        "sessionstate/_batch.py",
        (("            plans.append((j, i, handle, new, window))\n", ""),),
        ("tests/core/test_batch_kv.py",),
    ),
    Mutant(
        "unstack-commits-kv-to-another-session",
        "unstacking a batch appends each record's new tokens to another record's handle",
        "sessionstate/_batch.py",
        (
            (
                "            plans.append((j, i, handle, new, window))\n",
                "            plans.append((j, i, handles[-1 - i], new, window))\n",
            ),
        ),
        ("tests/core/test_batch_kv.py",),
    ),
    Mutant(
        "unstack-commits-kv-outside-a-transaction",
        "a batch's KV commit that fails part way keeps the blocks its first appends took",
        "sessionstate/_batch.py",
        (("            transactions.enter_context(pool.transaction())\n", "            pass\n"),),
        ("tests/core/test_batch_kv.py",),
    ),
    Mutant(
        "step-never-checks-what-it-read",
        "a managed step that wrote into the record it read is published unseen (the guard "
        "records the versions anew)",
        "sessionstate/_manager/_stepping.py",
        (("            t.verify_read(session_id, read)\n", ""),),
        ("tests/manager/test_step_many_adversarial.py",),
    ),
    Mutant(
        "batch-invariant-runs-the-batch-kernel",
        "a batch-invariant DreamZero batch runs its denoiser on the whole batch anyway",
        "sessionstate/models/dreamzero/networks.py",
        (("                if batch_invariant:\n", "                if False:\n"),),
        ("tests/models/test_batch_models.py",),
    ),
    Mutant(
        "batched-chunks-keep-the-batch-alive",
        "a batched Cosmos3 step hands each session a view into the batch's latents",
        "sessionstate/models/cosmos3/_model.py",
        (
            (
                "        return [latents[i : i + 1].clone() for i in range(size)]\n",
                "        return [latents[i : i + 1] for i in range(size)]\n",
            ),
        ),
        ("tests/models/test_batch_models.py",),
    ),
    Mutant(
        "cosmos3-bespoke-table-always-evicts",
        "Cosmos3's bespoke session table ignores on_full and always evicts",
        "sessionstate/models/cosmos3/_bespoke.py",
        (
            (
                "                max_sessions,\n                on_full,\n",
                '                max_sessions,\n                "evict",\n',
            ),
        ),
        ("tests/models/test_two_model_contract.py",),
    ),
    Mutant(
        "kv-reload-skips-copy",
        "unparking KV takes fresh blocks of the pool but never copies the tokens back",
        "sessionstate/_kv/_pool.py",
        (
            (
                "                self.storage[block : block + count].copy_("
                "data[row : row + count])\n",
                "                pass\n",
            ),
        ),
        ("tests/kv/test_kv_park.py",),
    ),
    Mutant(
        "snapshot-save-skips-fsync",
        "a snapshot is renamed into place before its bytes are synced to disk, so a crash "
        "after the save can leave an empty or partial file under the path",
        "sessionstate/_storage/_encode.py",
        (
            (
                "        if durable:\n            f.flush()\n            os.fsync(f.fileno())\n",
                "        pass\n",
            ),
        ),
        ("tests/storage/test_snapshot_hostile.py",),
    ),
    Mutant(
        "host-slot-views-at-wrong-offsets",
        "the host tier's consolidated slot hands every storage the slot's first bytes, so a "
        "restore rebuilds the views over the wrong offsets",
        "sessionstate/_storage/_park.py",
        (
            (
                "        views = [slots[device][offset : offset + n] "
                "for device, offset, n in places]\n",
                "        views = [slots[device][0:n] for device, offset, n in places]\n",
            ),
        ),
        ("tests/storage/test_hostpool.py", "tests/storage/test_park.py"),
    ),
    Mutant(
        "host-whole-runs-overlap",
        "the host tier's consolidated runs of whole tensors take no room in the slot, so the "
        "run of the next dtype is copied over the previous one",
        "sessionstate/_storage/_park.py",
        (
            (
                "        spans.append((device, dtype, offset, nbytes, at))\n"
                "        devices[device] = offset + -(-nbytes // alignment) * alignment\n",
                "        spans.append((device, dtype, offset, nbytes, at))\n",
            ),
        ),
        ("tests/storage/test_park.py",),
    ),
    Mutant(
        "host-whole-tensor-sharing-a-storage",
        "a whole tensor whose storage another tensor of the tree reaches is restored into a "
        "storage of its own, so the two no longer share it",
        "sessionstate/_storage/_park.py",
        (("            shared.add(first)\n", "            pass\n"),),
        ("tests/storage/test_park.py",),
    ),
    Mutant(
        "kv-park-reads-runs-from-the-slot-index",
        "parking KV copies a run of consecutive blocks from the pool at its slot index "
        "instead of its block id (right only when a session's blocks start at block 0)",
        "sessionstate/_kv/_pool.py",
        (
            (
                "            dest[slot:end].copy_(src[block : block + end - slot], "
                "non_blocking=cuda)\n",
                "            dest[slot:end].copy_(src[slot:end], non_blocking=cuda)\n",
            ),
        ),
        ("tests/kv/test_kv_park.py", "tests/kv/test_kv_stateful.py"),
    ),
    Mutant(
        "kv-blocks-not-freeable",
        "parking for pool blocks skips a KVHandle's blocks (as before KV could park)",
        "sessionstate/_manager/_policy.py",
        (
            (
                "        if obj.parkable and any(entry[3] and frees(entry) for entry in "
                'values[("o", name)].entries)\n',
                "        if obj.parkable and any(entry[3] and frees(entry) and "
                'type(entry[1]).__name__ != "EngineBlock" '
                'for entry in values[("o", name)].entries)\n',
            ),
        ),
        ("tests/kv/test_kv_park.py", "tests/models/dreamzero/test_kv_park_dreamzero.py"),
    ),
    Mutant(
        "manager-never-makes-step-room",
        "the manager steps a session without parking other sessions' blocks when a pool it "
        "was given runs short",
        "sessionstate/_manager/_decide.py",
        (
            (
                "    return free >= per_step * sessions + prefetching * (session_blocks or 0)",
                "    return True",
            ),
        ),
        (
            "tests/manager/test_decide.py",
            "tests/models/dreamzero/test_kv_park_dreamzero.py",
            "tests/models/dreamzero/test_pool_pressure_record.py",
        ),
    ),
    Mutant(
        "prefetch-ignores-budget",
        "a prefetch starts whether or not its bytes fit under max_bytes",
        "sessionstate/_manager/_prefetch.py",
        (
            (
                "        if t.policy.over(t.ledger, extra):\n            if sooner is None:\n",
                "        if False:\n            if sooner is None:\n",
            ),
        ),
        ("tests/manager/test_prefetch.py",),
    ),
    Mutant(
        "refused-put-keeps-a-cycle",
        "a refusal (a record over the whole budget, the cap, no room) keeps its error in the frame",
        "sessionstate/_manager/_table.py",
        (
            (
                "        try:\n            raise error\n        finally:\n            del error\n",
                "        raise error\n",
            ),
        ),
        (
            "tests/manager/test_kv_budget_stateful.py::"
            "test_every_refusal_leaves_no_reference_cycle_holding_the_callers_blocks",
        ),
    ),
    Mutant(
        "kv-cache-commit-keeps-the-old-handle",
        "a KVCache commit claims its old handle stays a leaf, so the ledger never counts the new",
        "sessionstate/_kv/_cache.py",
        (("new, self, 0 if self.handle is None else 1,", "new, self, 0,"),),
        ("tests/manager/test_ledger_fast_paths.py",),
    ),
    Mutant(
        "kv-append-skips-the-handle-check",
        "KVPool.append writes after a handle that is dead or of another pool (the check a "
        "valid call passes at the cost of a comparison never falls back to the full one)",
        "sessionstate/_kv/_pool.py",
        (('            self._check(handle, "append to")\n', "            pass\n"),),
        ("tests/kv/test_kvpool.py",),
    ),
    Mutant(
        "kv-handle-never-gives-blocks-back",
        "a collected KVHandle keeps its blocks (the lease is never released)",
        "sessionstate/_kv/_pool.py",
        (
            (
                "            self._lease.release()\n        except",
                "            pass\n        except",
            ),
        ),
        ("tests/manager/test_ledger_fast_paths.py", "tests/kv/test_kvpool.py"),
    ),
    Mutant(
        "ledger-skips-tensor-attributes",
        "the ledger's short cut for leaf values counts a tensor attribute as holding nothing",
        "sessionstate/_manager/_ledger.py",
        (
            (
                "    if kind in _SCALAR_LEAVES:  # a leaf",
                "    if kind in _SCALAR_LEAVES or kind is torch.Tensor:  # a leaf",
            ),
        ),
        ("tests/manager/test_ledger_fast_paths.py",),
    ),
    Mutant(
        "ledger-cache-short-cut-skips-a-leaf",
        "the ledger's walk of a flat feature cache leaves out its first tensor",
        "sessionstate/_manager/_ledger.py",
        (
            (
                "return [leaf for leaf in contents if leaf is not None]",
                "return [leaf for leaf in contents[1:] if leaf is not None]",
            ),
        ),
        ("tests/manager/test_ledger_fast_paths.py",),
    ),
    Mutant(
        "lazy-ledger-never-remeasures",
        "the manager's (lazy) ledger keeps its first measured union after ranges are added",
        "sessionstate/_manager/_ledger.py",
        (
            (
                "            if not count and tracked:\n                pending.append((1, *span))",
                "            if False:\n                pending.append((1, *span))",
            ),
        ),
        ("tests/manager/test_ledger_fast_paths.py", "tests/manager/test_ledger_overlaps.py"),
    ),
    Mutant(
        "lazy-ledger-misses-an-overlap",
        "the manager's (lazy) ledger adds an overlapping range's whole length to its union",
        "sessionstate/_manager/_ledger.py",
        (("                        disjoint = False\n", "                        pass\n"),),
        ("tests/manager/test_ledger_fast_paths.py", "tests/manager/test_ledger_overlaps.py"),
    ),
    Mutant(
        "lazy-ledger-grows-unread",
        "the manager's (lazy) ledger whose stats() is never read keeps every range change",
        "sessionstate/_manager/_ledger.py",
        (
            (
                "        return len(self._pending) > self._fold_at\n",
                "        return False\n",
            ),
        ),
        ("tests/manager/test_ledger_fast_paths.py",),
    ),
    Mutant(
        "lazy-ledger-trusts-every-storage",
        "the manager's (lazy) ledger counts a storage over memory it does not own by its size",
        "sessionstate/_manager/_ledger.py",
        (("                and keepalive.resizable()\n", "                and True\n"),),
        ("tests/manager/test_ledger_overlaps.py", "tests/manager/test_ledger_fast_paths.py"),
    ),
    Mutant(
        "lazy-ledger-skips-owned-placement",
        "the manager's (lazy) ledger, once its ranges are sorted, does not place an owned one",
        "sessionstate/_manager/_ledger.py",
        (
            (
                "            if tracked and device in tracked:\n"
                "                self._shared[device].place(1,",
                "            if False:\n                self._shared[device].place(1,",
            ),
        ),
        ("tests/manager/test_ledger_overlaps.py", "tests/manager/test_ledger_fast_paths.py"),
    ),
    Mutant(
        "lazy-ledger-stays-sorted",
        "the manager's (lazy) ledger keeps placing owned ranges after its last shared one went",
        "sessionstate/_manager/_ledger.py",
        (
            (
                "none to place until a shared one\n            self.sorted = False\n",
                "none to place until a shared one\n            pass\n",
            ),
        ),
        ("tests/manager/test_ledger_overlaps.py",),
    ),
    Mutant(
        "lazy-ledger-blocks-beside-their-pool",
        "the manager's (lazy) ledger counts a KV block by size while its pool's storage is held",
        "sessionstate/_manager/_ledger.py",
        (
            (
                "    if not entry[2] or pool in refs or not isinstance(keepalive, torch.Tensor):",
                "    if not entry[2] or not isinstance(keepalive, torch.Tensor):",
            ),
        ),
        ("tests/manager/test_ledger_overlaps.py",),
    ),
    Mutant(
        "lazy-ledger-pool-beside-its-blocks",
        "the manager's (lazy) ledger counts a pool's storage by size while its blocks are",
        "sessionstate/_manager/_ledger.py",
        (
            (
                "                and identity not in pools  # not a pool",
                "                and True  # not a pool",
            ),
        ),
        ("tests/manager/test_ledger_overlaps.py",),
    ),
    Mutant(
        "reload-gives-blocks-back-twice",
        "a KV reload makes each pool's handles as it fills it, and a failure in a later pool "
        "gives the earlier pools' blocks back twice (through the dropped handles and again)",
        "sessionstate/_kv/_pool.py",
        (
            (
                "    taken: list[list[int]] = []  # per pool: fresh blocks, for the saved blocks "
                "not reused\n",
                "    taken: list[list[int]] = []\n    early: list[Any] = []\n",
            ),
            (
                '                group["pool"]._fill(blocks, group["blocks"], fills, fresh_rows)\n',
                '                group["pool"]._fill(blocks, group["blocks"], fills, fresh_rows)\n'
                "                early.append(\n"
                '                    group["pool"]._adopt_blocks(blocks, facts[len(early)])\n'
                "                )\n",
            ),
            (
                "    except BaseException:\n"
                "        for group, again, blocks in itertools.zip_longest(groups, reused, taken):",
                "    except BaseException:\n"
                "        early.clear()\n"
                "        for group, again, blocks in itertools.zip_longest(groups, reused, taken):",
            ),
            (
                "                if self._refs[block] == 0 and block not in free:",
                "                if self._refs[block] == 0:",
            ),
        ),
        ("tests/kv/test_kv_park.py",),
    ),
    Mutant(
        "reload-marks-blocks-empty",
        "a KV reload marks its blocks empty, so the next append copies on write (a spare block "
        "after every unpark)",
        "sessionstate/_kv/_pool.py",
        (
            (
                "                self._filled[block] = fill\n",
                "                self._filled[block] = 0\n",
            ),
        ),
        ("tests/kv/test_kv_park.py",),
    ),
    Mutant(
        "offload-keeps-the-last-listed-fill",
        "a block shared by several handles is offloaded with the fill of the last handle listed, "
        "not the longest (the longer handle's last tokens come back as zeros)",
        "sessionstate/_kv/_pool.py",
        (
            (
                "            fills[g][slot] = max(fills[g][slot], fill)\n",
                "            fills[g][slot] = fill\n",
            ),
        ),
        ("tests/kv/test_kv_park.py",),
    ),
    Mutant(
        "dropped-prefetch-not-waited-for",
        "dropping, evicting or replacing a prefetched session does not wait for its running "
        "background restore (its pool blocks come back later, not when the call returns)",
        "sessionstate/_manager/_parking.py",
        (
            (
                "    handle.wait_prefetch()\n    handle.discard_prefetch()\n",
                "    handle.discard_prefetch()\n",
            ),
        ),
        ("tests/manager/test_prefetch.py",),
    ),
    Mutant(
        "failed-prefetch-keeps-its-charge",
        "a get whose parked bytes fail their check leaves the session's prefetch reserved",
        "sessionstate/_manager/_room.py",
        (
            (
                "        parking.discard(session_id)  # a failed prefetch's charge goes too\n",
                "        pass\n",
            ),
        ),
        ("tests/manager/test_prefetch.py",),
    ),
    Mutant(
        "reading-parked-state-takes-device-room",
        "peek(on_host=True), and so snapshot and export, unpark a parked session onto its "
        "devices and pools instead of reading it in host memory",
        "sessionstate/_manager/_access.py",
        (("        return state.unpark_on_host()\n", "        return state.unpark()\n"),),
        ("tests/storage/test_park_reading.py",),
    ),
    Mutant(
        "get-makes-no-kv-room",
        "a get of a parked session whose KV pool is short raises instead of parking others' KV",
        "sessionstate/_manager/_room.py",
        (("            if pool is None or id(pool) in tried:\n", "            if True:\n"),),
        ("tests/storage/test_park_reading.py",),
    ),
    Mutant(
        "reduced-precision-cpu-convolutions",
        "a bfloat16 or float16 DreamZero convolves with torch's slow reduced-precision CPU "
        "kernel instead of in float32",
        "sessionstate/models/dreamzero/networks.py",
        (("            if self.dtype in _NO_FAST_CPU_CONV:\n", "            if False:\n"),),
        ("tests/models/dreamzero/test_dtypes.py",),
    ),
    Mutant(
        "fork-sibling-releases-shared-parked-bytes",
        "a session that unparks or goes releases the parked bytes a fork's sibling still holds",
        "sessionstate/_manager/_parking.py",
        (
            (
                "        return (\n            handle_id in self._taking\n",
                "        return False and (\n            handle_id in self._taking\n",
            ),
        ),
        ("tests/manager/test_fork.py", "tests/manager/test_fork_stateful.py"),
    ),
    Mutant(
        "fork-family-parks-per-branch",
        "an object a fork's sibling parked already is copied to the tier again",
        "sessionstate/_manager/_parking.py",
        (
            (
                "            if known is None or known[0]() is not obj or",
                "            if True or known is None or known[0]() is not obj or",
            ),
        ),
        ("tests/manager/test_fork.py",),
    ),
    Mutant(
        "fork-family-unparks-into-copies",
        "an object a fork's sibling unparked and still holds comes back as a copy",
        "sessionstate/_manager/_parking.py",
        (
            (
                "                    candidate = entry.ref()\n",
                "                    candidate = None\n",
            ),
        ),
        ("tests/manager/test_fork.py",),
    ),
    Mutant(
        "failed-unpark-keeps-restored-trees",
        "an unpark that fails in a later handle keeps the earlier handles' restored trees (their "
        "engine blocks) until the caller lets go of the error",
        "sessionstate/_session.py",
        (
            (
                "            trees.clear()\n            objects.clear()\n            raise\n",
                "            raise\n",
            ),
        ),
        ("tests/storage/test_park_reading.py",),
    ),
    Mutant(
        "with-values-skips-the-bucket-check",
        "with_values lets one name be both a state object and an attribute",
        "sessionstate/_session.py",
        (
            (
                "            _check_disjoint(new_objects, new_attrs)\n",
                "            pass\n",
            ),
        ),
        ("tests/manager/test_ledger_fast_paths.py",),
    ),
    # -- random state (issue 38) --
    Mutant(
        "fork-shares-the-random-key",
        "a fork hands every branch the source's random key instead of splitting it",
        "sessionstate/_manager/_family.py",
        (
            (
                "records = (state,) * n if share_random else state.split_random(n)",
                "records = (state,) * n",
            ),
        ),
        ("tests/manager/test_fork.py",),
    ),
    Mutant(
        "draw-keeps-the-key",
        "a draw returns the key it drew from, not the next one",
        "sessionstate/_random.py",
        (("return gen, self._at(stream, counter + 1)", "return gen, self._at(stream, counter)"),),
        ("tests/core/test_random.py",),
    ),
    Mutant(
        "bespoke-fork-shares-the-random-key",
        "the bespoke path's fork deep-copies the key instead of splitting it as the manager does",
        "sessionstate/models/_kit.py",
        (
            (
                "    if share_random or not isinstance(key, RandomKey):",
                "    if True:",
            ),
        ),
        ("tests/models/test_random_models.py",),
    ),
    Mutant(
        "kept-copy-ignores-versions",
        "a park takes a kept copy back for the very object unparked, even after an in-place "
        "write into it",
        "sessionstate/_manager/_parking.py",
        (
            (
                'if restored.ref() is obj and _versions(obj, held.get(("o", name))) == ',
                'if restored.ref() is obj or _versions(obj, held.get(("o", name))) == ',
            ),
        ),
        ("tests/manager/test_kept_copies.py",),
    ),
    Mutant(
        "kept-copy-splits-a-shared-storage",
        "objects unchanged since their unpark are parked apart from the changed ones even "
        "when a storage reaches both",
        "sessionstate/_manager/_parking.py",
        (("        if not seen.isdisjoint(mine):\n", "        if False:\n"),),
        ("tests/manager/test_kept_copies.py",),
    ),
    Mutant(
        "kept-copy-outlives-its-objects",
        "a kept copy whose objects were freed stays until the session parks again",
        "sessionstate/_manager/_parking.py",
        (
            (
                "            for name in [n for n, r in clean.items() if r.ref() is None]:",
                "            for name in []:",
            ),
        ),
        ("tests/manager/test_kept_copies.py",),
    ),
    Mutant(
        "full-host-pool-keeps-kept-copies",
        "a park the host pool cannot hold spills to disk while kept copies fill the pool",
        "sessionstate/_manager/_parking.py",
        (
            (
                "        dropped = False\n        for session_id in list(self._kept):",
                "        return False\n        for session_id in list(self._kept):",
            ),
        ),
        ("tests/manager/test_kept_copies.py",),
    ),
    Mutant(
        "sibling-share-ignores-versions",
        "a park takes a sibling's parked bytes for an object written in place since",
        "sessionstate/_manager/_parking.py",
        (
            (
                "if then is not None and then[0]() is obj and _versions(obj, item) == then[1]:",
                "if True:",
            ),
        ),
        ("tests/manager/test_kept_copies.py",),
    ),
    Mutant(
        "room-scan-asks-every-parked-session",
        "a scan for room asks every other session what it could park, at every get, those "
        "with nothing left to park included",
        "sessionstate/_manager/_room.py",
        (("        if idle.get(other, NO_DEVICES) >= devices:\n", "        if False:\n"),),
        ("tests/manager/test_budget_incremental.py",),
    ),
    Mutant(
        "room-scan-forgets-an-unpark",
        "an unparked session stays known as holding nothing to park, so it is never parked "
        "again for room",
        "sessionstate/_manager/_room.py",
        (
            (
                "    t.set_record(session_id, state)\n"
                "    t.ledger.set(session_id, t.ledger.values_for(session_id, state))",
                "    t.records[session_id] = state\n"
                "    t.ledger.set(session_id, t.ledger.values_for(session_id, state))",
            ),
        ),
        ("tests/manager/test_budget_incremental.py", "tests/manager/test_budget_stateful.py"),
    ),
    Mutant(
        "room-maker-asks-every-session",
        "making a step's pool room asks every other session what it could free, at every "
        "step, those whose K/V is parked included",
        "sessionstate/_manager/_room.py",
        (
            (
                "            if remembered is not None and remembered in idle.get(other, "
                "NO_DEVICES):\n",
                "            if False:\n",
            ),
        ),
        ("tests/manager/test_room_maker.py",),
    ),
    Mutant(
        "kv-unpark-takes-fresh-blocks-only",
        "unparking K/V never takes back a live block of the same content: a family's shared "
        "blocks come back as per-session copies",
        "sessionstate/_kv/_pool.py",
        (("                if valid >= fill:\n", "                if False:\n"),),
        ("tests/kv/test_kv_family_park.py", "tests/manager/test_fork_kv_stateful.py"),
    ),
    Mutant(
        "kv-restored-block-keeps-a-fresh-content",
        "a block restored from a parked copy keeps the fresh content id it was taken with, so "
        "no sibling unparked after it finds it",
        "sessionstate/_kv/_pool.py",
        (
            (
                "                self._content[block] = content\n",
                "                self._content[block] = own\n",
            ),
        ),
        ("tests/kv/test_kv_family_park.py", "tests/manager/test_fork_kv_stateful.py"),
    ),
    Mutant(
        "kv-park-labels-a-restored-blocks-own-tokens",
        "a restored block written past its restored tokens is parked under its content for "
        "all of them, so an unpark takes another block of the content for its own tokens",
        "sessionstate/_kv/_pool.py",
        (("                    if self._valid[block] >= 0:\n", "                    if False:\n"),),
        ("tests/kv/test_kv_family_park.py",),
    ),
    Mutant(
        "kv-rollback-keeps-the-content",
        "a rolled-back step's forgotten tokens stay under the block's content, so a copy of "
        "them is taken back onto a block a sibling wrote other tokens into",
        "sessionstate/_kv/_pool.py",
        (
            (
                "                            pool._relabel(block)\n",
                "                            pass\n",
            ),
        ),
        ("tests/kv/test_kv_family_park.py",),
    ),
    Mutant(
        "kv-rollback-lowers-a-block-taken-again",
        "a rollback lowers the fill of a block freed and taken again since (by a reload), "
        "under the handles that hold it now",
        "sessionstate/_kv/_pool.py",
        (
            (
                "pool._takes[block] == taken and pool._filled[block] != filled:",
                "pool._filled[block] != filled:",
            ),
        ),
        ("tests/kv/test_kv_family_park.py",),
    ),
    Mutant(
        "parked-handle-count-never-drops",
        "a session letting go of a parked handle leaves the count of its holders as it was, "
        "so the handle is never released",
        "sessionstate/_manager/_parking.py",
        (
            (
                "            left = counts[id(handle)] - 1\n",
                "            left = counts[id(handle)]\n",
            ),
        ),
        ("tests/storage/test_host_pool_manager.py", "tests/manager/test_fork.py"),
    ),
    Mutant(
        "handed-back-object-unchecked",
        "an unpark hands a sibling's restored object back (or the session's own) though it "
        "was written in place since it came back",
        "sessionstate/_manager/_parking.py",
        (
            (
                "if candidate is not None and _versions(candidate) == entry.versions:",
                "if candidate is not None:",
            ),
        ),
        ("tests/manager/test_kept_copies.py",),
    ),
    Mutant(
        "full-pool-releases-what-a-park-takes-back",
        "a full host pool lets go of a kept copy the running park is taking back",
        "sessionstate/_manager/_parking.py",
        (("            handle_id in self._taking\n", "            False\n"),),
        ("tests/manager/test_kept_copies.py",),
    ),
    Mutant(
        "sibling-share-checks-one-object",
        "a park takes a sibling's parked handle when the session holds all of its objects, "
        "though one was written through another object sharing its storage",
        "sessionstate/_manager/_parking.py",
        (
            (
                "        unchanged = {id(state.objects[name]) for name in found}\n",
                "        unchanged = {id(state.objects[name]) for name in names}\n",
            ),
        ),
        ("tests/manager/test_kept_copies.py",),
    ),
    Mutant(
        "hand-back-object-by-object",
        "an unpark hands back each unchanged object of a handle though another of them, "
        "sharing its storage, was written",
        "sessionstate/_manager/_parking.py",
        (
            (
                "                if all(o is not None for o in objects.values())\n",
                "                if True\n",
            ),
        ),
        ("tests/manager/test_kept_copies.py",),
    ),
    Mutant(
        "fork-refusal-forgets-the-source",
        "the cap is thought to hold as many branches as places, the source's included",
        "sessionstate/_manager/_decide.py",
        (("    if branches <= cap - 1 and", "    if branches <= cap and"),),
        ("tests/manager/test_decide.py", "tests/manager/test_fork.py"),
    ),
    Mutant(
        "batch-fits-counts-held-places-as-free",
        "with on_full='refuse' a batch's new sessions may take places other sessions hold",
        "sessionstate/_manager/_decide.py",
        (("fresh <= cap - held)", "fresh <= cap)"),),
        ("tests/manager/test_decide.py", "tests/manager/test_get_put_many.py"),
    ),
    Mutant(
        "serving-restore-ignores-room",
        "on the simulated clock a restore starts before the park that made its room is done",
        "sessionstate/serving/_sim.py",
        (
            (
                "                    earliest = max(room, self._park_end.get(sid, 0.0))\n"
                "                    self._ready[sid] = self._copy(",
                "                    earliest = max(now, self._park_end.get(sid, 0.0))\n"
                "                    self._ready[sid] = self._copy(",
            ),
        ),
        ("tests/serving/test_server.py",),
    ),
    Mutant(
        "serving-admission-ignores-copies",
        "admission by deadline counts steps only, not the swaps of sessions beyond the resident",
        "sessionstate/serving/_admission.py",
        (
            (
                "        return self.compute_s(n) + 2 * self.copy_s(n) <= budget + 1e-12\n",
                "        return self.compute_s(n) <= budget + 1e-12\n",
            ),
        ),
        ("tests/messages/test_messages_serving.py", "tests/serving/test_plan_vs_harness.py"),
    ),
    Mutant(
        "serving-late-chunk-slips",
        "a late chunk moves the next chunk's deadline (deadlines slip instead of staying put)",
        "sessionstate/serving/_server.py",
        (
            (
                "        return self.t0 + self.k * period\n",
                "        return max(self.t0 + self.k * period, self.last_done + period)\n",
            ),
        ),
        ("tests/serving/test_server.py",),
    ),
    Mutant(
        "plan-parks-the-random-key",
        "the capacity plan counts an unparkable state object (the random key) as parked",
        "sessionstate/cli/_plan.py",
        (
            (
                'elif row["bucket"] == "object" and row.get("parkable", True):',
                'elif row["bucket"] == "object":',
            ),
        ),
        (
            "tests/cli/test_cli_plan.py::"
            "test_the_plan_counts_a_budgeted_managers_parked_session_exactly",
        ),
    ),
    Mutant(
        "trace-main-thread-only",
        "`ab --trace` profiles only the thread that starts the profiler (no prefetch worker)",
        "sessionstate/cli/_ab.py",
        (("experimental_config=all_threads_config(),", "experimental_config=None,"),),
        ("tests/cli/test_cli.py::test_ab_trace_writes_both_paths_with_the_librarys_ranges",),
    ),
    Mutant(
        "span-thread-flag-only",
        "a library range is recorded only where torch's thread-local profiler flag is on",
        "sessionstate/_manager/_events.py",
        (
            (
                "_profiler_enabled() or torch.autograd.profiler._is_profiler_enabled:",
                "_profiler_enabled():",
            ),
        ),
        ("tests/manager/test_observability.py::test_parks_unparks_and_steps_are_profiler_ranges",),
    ),
    Mutant(
        "split-skips-an-empty-key",
        "a record whose random key is not allocated yet forks into branches that draw alike",
        "sessionstate/_session.py",
        (
            (
                "            if isinstance(obj, RandomKey):\n",
                "            if isinstance(obj, RandomKey) and obj.is_allocated:\n",
            ),
        ),
        (
            "tests/storage/test_golden_snapshots.py::"
            "test_a_keyless_golden_session_forked_before_its_first_step_draws_apart",
        ),
    ),
    Mutant(
        "cli-budget-count-only",
        "`ab --max-bytes` takes a byte count only, not the device=count form",
        "sessionstate/cli/_common.py",
        (("        type=budget,\n", "        type=nbytes,\n"),),
        ("tests/cli/test_cli_arguments.py",),
    ),
    Mutant(
        "keep-branch-splits-the-key",
        "the kept branch gets a split of its random key, not its own",
        "sessionstate/models/planning.py",
        (
            (
                "pipe.fork(branch_id, session_id, share_random=True)",
                "pipe.fork(branch_id, session_id)",
            ),
        ),
        (
            "tests/cli/test_cli_rollout.py::"
            "test_keep_branch_gives_a_hand_made_branch_the_sessions_id",
        ),
    ),
    Mutant(
        "piped-tables-80-columns",
        "a command's tables fit rich's default 80 columns when stdout is not a terminal",
        "sessionstate/cli/_common.py",
        (("    return Console(width=PIPED_WIDTH)\n", "    return console\n"),),
        ("tests/cli/test_cli_inspect.py::test_piped_tables_print_every_header_and_cell_whole",),
    ),
    Mutant(
        "inspect-root-counts-without-kv",
        "inspect's root structure counts tensors without the K/V leaves' (two counts)",
        "sessionstate/_storage/_inspect.py",
        (
            (
                '"root": _structure(tree, views, depth=0, leaves=leaves),',
                '"root": _structure(tree, views, depth=0),',
            ),
        ),
        (
            "tests/cli/test_cli_inspect.py::"
            "test_a_family_file_is_shown_per_session_with_one_tensor_count",
        ),
    ),
    Mutant(
        "belady-order-reversed",
        "under a schedule, room-making parks the session used soonest first",
        "sessionstate/_manager/_schedule.py",
        (("        reverse=True,\n", "        reverse=False,\n"),),
        ("tests/manager/test_schedule.py", "tests/manager/test_expect.py"),
    ),
    Mutant(
        "schedule-ignored",
        "`expect`'s schedule is kept but room-making stays least recently used first",
        "sessionstate/_manager/_room.py",
        (("    return park_order(list(t.records), t.schedule)\n", "    return list(t.records)\n"),),
        ("tests/manager/test_expect.py",),
    ),
    Mutant(
        "scheduled-prefetch-parks-sooner",
        "a prefetch `expect` starts may park a session the schedule uses sooner",
        "sessionstate/_manager/_prefetch.py",
        (
            (
                "            if not start_prefetch(t, session_id, True, sooner):\n",
                "            if not start_prefetch(t, session_id, True, {session_id}):\n",
            ),
        ),
        ("tests/manager/test_expect.py",),
    ),
    Mutant(
        "scheduled-prefetch-over-budget",
        "a prefetch `expect` starts skips the budget check",
        "sessionstate/_manager/_prefetch.py",
        (
            (
                "        if t.policy.over(t.ledger, extra):\n",
                "        if sooner is None and t.policy.over(t.ledger, extra):\n",
            ),
        ),
        ("tests/manager/test_expect.py",),
    ),
    Mutant(
        "prefetch-plan-past-a-new-session",
        "`expect`'s prefetch plan goes on past a session not held yet",
        "sessionstate/_manager/_schedule.py",
        (
            (
                "        if session_id not in held:\n            break\n",
                "        if session_id not in held:\n            continue\n",
            ),
        ),
        ("tests/manager/test_schedule.py",),
    ),
    Mutant(
        "refused-batch-releases-replaced-parked-bytes",
        "a batch store releases the parked bytes of the records it replaces before it is "
        "stored whole, so a refusal puts back a parked record whose bytes are gone",
        "sessionstate/_manager/_parking.py",
        (("            or any(obj.handle is handle for obj in self.replacing)\n", ""),),
        ("tests/manager/test_get_put_many.py",),
    ),
    Mutant(
        "refused-get-many-keeps-prefetched-restore",
        "a get_many the budget refuses keeps what check read and a prefetch restored, "
        "charged to nobody",
        "sessionstate/_manager/_access.py",
        (
            (
                "                for session_id in parked:  # what `check` read",
                "                for session_id in ():  # what `check` read",
            ),
        ),
        ("tests/manager/test_get_put_many.py",),
    ),
    Mutant(
        "fork-source-key-without-room",
        "a fork gives the source its new split key without making room for it",
        "sessionstate/_manager/_family.py",
        (
            (
                "                    make_room(t, source_id, {}, added)\n",
                "                    pass\n",
            ),
        ),
        ("tests/manager/test_fork.py",),
    ),
    Mutant(
        "unpark-charges-handed-back-bytes",
        "an unpark charges the parked bytes of objects a resident sibling hands back",
        "sessionstate/_manager/_parking.py",
        (
            (
                "        back = {id(parked[name].handle) for name in self.handed_back(session_id)}"
                "\n",
                "        back: set[int] = set()\n",
            ),
        ),
        ("tests/manager/test_fork.py",),
    ),
    Mutant(
        "batch-counts-shared-parked-bytes-per-member",
        "get_many charges a parked handle its members share once per member",
        "sessionstate/_manager/_parking.py",
        (
            (
                "            if counted is not None and id(handle) in counted:\n"
                "                continue\n",
                "",
            ),
        ),
        ("tests/manager/test_get_put_many.py",),
    ),
    Mutant(
        "failed-step-moves-lru",
        "a step's read makes its sessions the most recently used before the step publishes, "
        "so a failed or refused step reorders the LRU",
        "sessionstate/_manager/_access.py",
        (
            (
                "        if touch:\n            t.records.move_to_end(session_id)\n",
                "        t.records.move_to_end(session_id)\n",
            ),
            (
                "        if touch:\n            for session_id in ids:\n",
                "        if True:\n            for session_id in ids:\n",
            ),
        ),
        ("tests/manager/test_step_many.py",),
    ),
    Mutant(
        "put-many-leaves-lru",
        "put_many of held, resident sessions leaves them where they were in the LRU order",
        "sessionstate/_manager/_access.py",
        (
            (
                "        table.move_to_end(session_id)\n"
                "        parking.track(session_id, state, {})\n",
                "        parking.track(session_id, state, {})\n",
            ),
        ),
        ("tests/manager/test_get_put_many.py",),
    ),
    Mutant(
        "shared-sessions-only-after-a-fork",
        "stats() reports shared_sessions only once a fork was made (a restored family reads 0 "
        "on the gauge)",
        "sessionstate/_manager/_family.py",
        (
            (
                "        store_batch(t, pairs, ids)\n        t.families = True\n",
                "        store_batch(t, pairs, ids)\n",
            ),
        ),
        ("tests/manager/test_observability.py::test_a_restored_family_is_counted_as_sharing",),
    ),
    Mutant(
        "batch-peak-not-checked",
        "a batch that replaces held sessions is checked against the budget without the "
        "records its later members still hold, so it evicts others and is refused midway",
        "sessionstate/_manager/_access.py",
        (("    for k in range(len(olds) - 1) if any(olds[1:]) else ():\n", "    for k in ():\n"),),
        ("tests/manager/test_get_put_many.py",),
    ),
    Mutant(
        "get-many-skips-guard",
        "get_many hands out a batch without the immutability guard's check of each record",
        "sessionstate/_manager/_access.py",
        (
            (
                "        for session_id in ids:  # every record, before anything is parked or "
                "unparked\n"
                "            t.verify(session_id, t.records[session_id])\n",
                "",
            ),
        ),
        ("tests/manager/test_guard_batches.py",),
    ),
    Mutant(
        "family-read-skips-guard",
        "snapshot_many and peek_many read a family without the immutability guard's check",
        "sessionstate/_manager/_family.py",
        (
            (
                "            t.verify(session_id, state)\n            if state.parked:\n",
                "            if state.parked:\n",
            ),
        ),
        ("tests/manager/test_guard_batches.py",),
    ),
    Mutant(
        "fork-forgets-parked-kv",
        "fork does not tell parking that a branch of a K/V-parked source holds parked K/V",
        "sessionstate/_manager/_parking.py",
        (
            (
                "            self._kv_parked.add(branch_id)\n",
                "            pass\n",
            ),
        ),
        ("tests/manager/test_fork.py",),
    ),
    Mutant(
        "first-pool-transaction-only",
        "a step runs inside the first pool's transaction only, so a failed step keeps the "
        "blocks it took from the others",
        "sessionstate/_manager/_stepping.py",
        (("    for transaction in opened:\n", "    for transaction in opened[:1]:\n"),),
        ("tests/manager/test_step_many.py",),
    ),
    Mutant(
        "callback-interrupt-raised-mid-work",
        "a KeyboardInterrupt an on_event callback raises escapes at once, mid-unpark",
        "sessionstate/_manager/_events.py",
        (("                if not self.defer:\n", "                if True:\n"),),
        ("tests/manager/test_observability.py",),
    ),
    Mutant(
        "kv-parks-with-the-rest",
        "a record holding K/V parks its other objects into the K/V handle (never shared), so "
        "every sibling parks a shared history again",
        "sessionstate/_manager/_parking.py",
        (("    if held is None or len(names) < 2:\n", "    if True:\n"),),
        (
            "tests/manager/test_fork.py::"
            "test_a_kv_familys_other_objects_park_once_and_come_back_shared",
        ),
    ),
    Mutant(
        "stack-copies-an-equal-view",
        "stack keeps a leaf unbatched only when it is the very same tensor in every record, "
        "copying a storage every record reaches through its own equal view",
        "sessionstate/_batch.py",
        (
            (
                "            and leaf.untyped_storage()._cdata == storage\n",
                "            and False\n",
            ),
        ),
        (
            "tests/core/test_batch.py::"
            "test_a_storage_every_record_reaches_through_its_own_equal_view_stays_shared",
        ),
    ),
    Mutant(
        "stack-groups-views-by-offset-only",
        "stack groups the views of one storage when their offsets agree, whatever their strides",
        "sessionstate/_batch.py",
        (
            (
                "or (x.storage_offset(), x.stride()) != (y.storage_offset(), y.stride())",
                "or x.storage_offset() != y.storage_offset()",
            ),
        ),
        (
            "tests/core/test_batch.py::"
            "test_views_of_one_storage_are_grouped_only_when_offset_and_stride_agree",
        ),
    ),
    Mutant(
        "unstack-without-copies-copies",
        "unstack(copy=False) gives each record a copy of its slice, not a view of the stack",
        "sessionstate/_batch.py",
        (
            (
                "                leaves.append(x[i])\n",
                "                leaves.append(x[i].clone())\n",
            ),
        ),
        (
            "tests/core/test_batch.py::test_unstack_without_copies_gives_views_into_the_stacked_tensors",
        ),
    ),
    Mutant(
        "split-ignores-the-counter",
        "RandomKey.split hashes the stream alone: a key split after draws gives the keys a split "
        "before them gave",
        "sessionstate/_random.py",
        (('_hash(b"split", stream, counter, i)', '_hash(b"split", stream, 0, i)'),),
        ("tests/core/test_random.py::test_a_split_depends_on_where_the_key_stands",),
    ),
    Mutant(
        "kv-extended-holder-keeps-its-short-count",
        "a live block an unpark extends to a sibling's longer tokens still holds the content "
        "for its first tokens only, so a third sibling takes a fresh block",
        "sessionstate/_kv/_pool.py",
        (
            (
                "                    self._filled[block] = self._valid[block] = valid = fill\n",
                "                    self._filled[block] = valid = fill\n",
            ),
        ),
        (
            "tests/kv/test_kv_family_park.py::"
            "test_the_third_sibling_reuses_the_block_the_longer_one_came_back_on",
        ),
    ),
    Mutant(
        "stats-by-kind-last-reach-wins",
        "session_stats counts a storage an object and an attribute share as the kind that "
        "reaches it last (the attribute's), not the object's",
        "sessionstate/_manager/_decide.py",
        (("kinds.setdefault(entry[1], kind)", "kinds[entry[1]] = kind"),),
        (
            "tests/manager/test_observability.py::"
            "test_a_storage_an_object_and_an_attribute_share_counts_as_the_objects",
        ),
    ),
    Mutant(
        "metrics-pool-blocks-as-free",
        "the collector's pool_blocks gauge reads the pool's free blocks",
        "sessionstate/metrics.py",
        (('labels("pool", pool), total))', 'labels("pool", pool), nfree))'),),
        (
            "tests/manager/test_observability.py::"
            "test_a_scrape_reads_the_pool_refusal_repark_and_kept_metrics_as_stats_says",
        ),
    ),
    Mutant(
        "metrics-free-blocks-as-blocks",
        "the collector's pool_free_blocks gauge reads the pool's blocks",
        "sessionstate/metrics.py",
        (('labels("pool", pool), nfree))', 'labels("pool", pool), total))'),),
        (
            "tests/manager/test_observability.py::"
            "test_a_scrape_reads_the_pool_refusal_repark_and_kept_metrics_as_stats_says",
        ),
    ),
    Mutant(
        "metrics-refusals-unread",
        "the collector's refusals counter reads an event kind never emitted",
        "sessionstate/metrics.py",
        (('snap["events"].get("refuse", 0)', 'snap["events"].get("refused", 0)'),),
        (
            "tests/manager/test_observability.py::"
            "test_a_scrape_reads_the_pool_refusal_repark_and_kept_metrics_as_stats_says",
        ),
    ),
    Mutant(
        "metrics-reparks-as-parks",
        "the collector's reparks counter reads the parks",
        "sessionstate/metrics.py",
        (('("reparks", stats.get("reparks", 0)', '("reparks", stats.get("parks", 0)'),),
        (
            "tests/manager/test_observability.py::"
            "test_a_scrape_reads_the_pool_refusal_repark_and_kept_metrics_as_stats_says",
        ),
    ),
    Mutant(
        "metrics-kept-as-parked",
        "the collector's kept_bytes gauge reads the parked bytes",
        "sessionstate/metrics.py",
        (('        "nbytes_kept",\n', '        "nbytes_parked",\n'),),
        (
            "tests/manager/test_observability.py::"
            "test_a_scrape_reads_the_pool_refusal_repark_and_kept_metrics_as_stats_says",
        ),
    ),
    Mutant(
        "donate-ignores-holders",
        "a donating compiled step writes into a record, object or tensor held elsewhere",
        "sessionstate/_compile/_donation.py",
        (("        if outside > 0:\n", "        if False:\n"),),
        ("tests/compile/test_compile.py",),
    ),
    Mutant(
        "donate-moved-leaf-not-cloned",
        "a donating compiled step writes a leaf over one that moves into another's place "
        "without keeping its value first",
        "sessionstate/_compile/_step.py",
        (
            (
                "    pending = [(target, keep(value)) for target, value in writes]\n",
                "    pending = list(writes)\n",
            ),
        ),
        ("tests/compile/test_compile.py",),
    ),
    Mutant(
        "compile-structure-bound-off",
        "a compiled step compiles for any number of input structures",
        "sessionstate/_compile/_step.py",
        (
            (
                "                if len(self._seen) >= self.max_structures:\n",
                "                if False:\n",
            ),
        ),
        ("tests/compile/test_compile.py",),
    ),
    Mutant(
        "family-late-drop-fails",
        "a family migration whose source drops its copies late fails after the switch",
        "sessionstate/distributed/_router.py",
        (
            (
                "                except WorkerTimeoutError:\n"
                "                    pass  # it runs there in order; the copy is handed off and "
                "fenced until then\n"
                "                except _WorkerLostError as lost:\n"
                "                    self._worker_lost(lost.worker)\n"
                "                    break\n",
                "                except _WorkerLostError as lost:\n"
                "                    self._worker_lost(lost.worker)\n"
                "                    break\n",
            ),
        ),
        (
            "tests/distributed/test_distributed_faults.py::"
            "test_a_family_migration_timing_out_at_any_stage_leaves_it_whole_on_one_side",
        ),
    ),
    Mutant(
        "abort-drop-timeout-escapes",
        "undoing a migration's import lets a drop timeout escape, skipping the source's reclaim",
        "sessionstate/distributed/_router.py",
        (
            (
                "                except _WorkerLostError:\n"
                "                    dead.add(destination)\n"
                "                except Exception:\n"
                "                    pass  # a copy left behind is fenced: no call the router "
                "sends can reach it\n",
                "                except _WorkerLostError:\n"
                "                    dead.add(destination)\n",
            ),
        ),
        (
            "tests/distributed/test_distributed_faults.py::"
            "test_a_family_migration_timing_out_at_any_stage_leaves_it_whole_on_one_side",
        ),
    ),
    Mutant(
        "family-lost-source-drop-raises",
        "a family migration fails after its switch when the source dies dropping its copies",
        "sessionstate/distributed/_router.py",
        (
            (
                "                except _WorkerLostError as lost:\n"
                "                    self._worker_lost(lost.worker)\n"
                "                    break\n",
                "                except _WorkerLostError as lost:\n"
                "                    self._worker_lost(lost.worker)\n"
                "                    raise lost.error from None\n",
            ),
        ),
        (
            "tests/distributed/test_distributed_faults.py::"
            "test_a_family_whose_source_dies_mid_migration_is_on_the_destination_or_said_lost",
        ),
    ),
    Mutant(
        "family-outcome-claims-intact",
        "a failed family migration from a dead source says the records stay intact",
        "sessionstate/distributed/_router.py",
        (
            (
                "        # Where a family's sessions are after their failed migration.\n"
                "        if not lost:\n",
                "        # Where a family's sessions are after their failed migration.\n"
                "        if True:\n",
            ),
        ),
        (
            "tests/distributed/test_distributed_faults.py::"
            "test_a_family_whose_source_dies_mid_migration_is_on_the_destination_or_said_lost",
        ),
    ),
    Mutant(
        "restored-member-stays-in-family",
        "a session restored after its worker was lost stays listed in its family",
        "sessionstate/distributed/_router.py",
        (
            (
                "                # Restored alone, from its own snapshot: it shares nothing with "
                "its family.\n"
                "                self._part(sid)\n",
                "",
            ),
        ),
        (
            "tests/distributed/test_distributed_faults.py::"
            "test_a_family_whose_source_dies_mid_migration_is_on_the_destination_or_said_lost",
        ),
    ),
)


class MutantError(Exception):
    """A mutant cannot be applied, or its tests would not see it."""


def _copy_source(dest: Path) -> Path:
    src = dest / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return src


def _apply(mutant: Mutant, src: Path) -> None:
    target = src / mutant.path
    text = target.read_text()
    for old, new in mutant.substitutions:
        count = text.count(old)
        if count != 1:
            found = "not found" if count == 0 else f"found {count} times"
            msg = (
                f"Mutant {mutant.name!r}: the anchor text is {found} in src/{mutant.path} "
                f"(it must occur exactly once):\n{old}\nUpdate the anchor in tools/mutants.py "
                "to the current code."
            )
            raise MutantError(msg)
        text = text.replace(old, new)
    target.write_text(text)


def _pytest(src: Path, tests: tuple[str, ...], *, stop_early: bool) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    where = subprocess.run(
        [sys.executable, "-c", "import sessionstate; print(sessionstate.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).is_relative_to(src):
        msg = f"The tests would import sessionstate from {where}, not from {src}."
        raise MutantError(msg)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *tests]
    if stop_early:
        args.insert(4, "-x")
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, lines[-1] if lines else proc.stderr.strip()[-300:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--full", action="store_true", help="run all of tests/ for each mutant")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip checking that the tests pass on the unmutated copy first",
    )
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutants {unknown}; known: {sorted(known)}")
    chosen = [known[n] for n in args.names] if args.names else list(MUTANTS)
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.description} ({m.path}); caught by {', '.join(m.tests)}")
        return 0

    try:
        return _run(chosen, full=args.full, baseline=not args.no_baseline)
    except MutantError as exc:
        print(exc, file=sys.stderr)
        return 2


def _run(chosen: list[Mutant], *, full: bool, baseline: bool) -> int:
    with tempfile.TemporaryDirectory(prefix="sessionstate-mutants-") as tmp:
        # Every anchor is checked before any test runs.
        for m in chosen:
            _apply(m, _copy_source(Path(tmp) / f"check-{m.name}"))

        def tests_of(m: Mutant) -> tuple[str, ...]:
            return ("tests",) if full else m.tests

        if baseline:
            unmutated = tuple(dict.fromkeys(t for m in chosen for t in tests_of(m)))
            src = _copy_source(Path(tmp) / "baseline")
            code, summary = _pytest(src, unmutated, stop_early=True)
            print(f"baseline (no mutant): {summary}", flush=True)
            if code != 0:
                print("The tests fail without a mutant; fix them first.")
                return 2

        results: dict[str, str] = {}
        for m in chosen:
            src = _copy_source(Path(tmp) / m.name)
            _apply(m, src)
            code, summary = _pytest(src, tests_of(m), stop_early=True)
            verdict = {0: "SURVIVED", 1: "killed"}.get(code, f"ERROR (pytest exit {code})")
            results[m.name] = verdict
            print(f"{verdict:<9} {m.name}: {m.description} [{summary}]", flush=True)

    survivors = [n for n, v in results.items() if v == "SURVIVED"]
    errors = [n for n, v in results.items() if v not in ("killed", "SURVIVED")]
    print(
        f"{len(results) - len(survivors) - len(errors)} killed, {len(survivors)} survived"
        + (f": {', '.join(survivors)}" if survivors else "")
        + (f"; {len(errors)} could not run: {', '.join(errors)}" if errors else "")
    )
    if errors:
        return 2
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
