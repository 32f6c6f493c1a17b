"""Storage: snapshots of a record to one safetensors file (or bytes) and back, bit-identical.

The format stores each distinct *storage* once, as a raw ``uint8`` tensor named
``storage.<i>``, and describes every tensor leaf as a view of one of them (storage index,
dtype, shape, stride, storage offset). Two leaves that shared a storage share one again after
loading, so `nbytes_by_device` is unchanged by a round trip. The structure (record classes by
stable name, `SNAPSHOT_NAMES`; static fields, containers, JSON leaves), a format version, the
library and torch versions and an xxh3-64 checksum per storage go in the safetensors metadata as
one JSON document under the key ``sessionstate``.

Loading never unpickles: records are rebuilt through their constructors (their validators
run), and only classes registered as records in this process are used. The one import a
loader may make is of a module under ``sessionstate.`` (a library class's location in
`SNAPSHOT_NAMES`, or a name under the package); any other record class must have been
imported by the caller first.

A leaf that is neither a tensor nor a JSON value (an engine's handle to memory it owns, such
as a `KVHandle`) is saved by value when its class is registered with `register_snapshot_leaf`:
the class turns all its leaves in one snapshot into one payload of tensors and JSON values,
stored like the rest, and rebuilds them from it at load.

A file is format version 4 (`FORMAT_VERSION`): the JSON document carries an xxh3-64 of its own
(`CHECKSUM_KEY`), so a changed byte anywhere in the structure is refused as the storages'
are. Files of versions 1 to 3 (CRC-32 checksums, the document's under `CRC32_KEY` in version
3) load unchanged (committed ones are under ``tests/data/``).
Before anything is allocated, every number in the header is checked exactly (ints, never
bools, floats or strings; in range; storages inside the file and not overlapping), so a
loader never allocates more than the file's storages hold; a hostile file gets a
`SnapshotError` naming the value, never a raw error.

For a transport that moves arrays without copying them (Ray's object store), `dumps_parts`
returns the same snapshot in parts (the header, then each storage as a NumPy array over the
record's memory) and `loads_parts` reads it back with the same checks, copying each storage once.

The storage walk (`collect_storages`) and the rebuild (`rebuild_views`) are the library's one
way to move a record's bytes: whatever moves storages elsewhere and back uses them.

This package's face gathers the snapshot API; the format (versions, checksums, the walk and the
rebuild, stable names), the encoder, the decoder and the inspection each live in a module of
their own (`_format`, `_encode`, `_decode`, `_inspect`); so do the park tiers (`_park`: host
memory and disk, and the spool directories a disk tier writes to; `_hostpool`: the preallocated
host buffer pool a host tier may copy into) and the device mover
(`_movers`: `to_device`), which move storages through the same walk.
"""

from __future__ import annotations

from sessionstate._storage._decode import load_state, loads_parts, loads_state, read_header
from sessionstate._storage._encode import (
    dumps_parts,
    dumps_state,
    record_device,
    recorded_devices,
    recording,
    save_state,
)
from sessionstate._storage._format import (
    CHECKSUM_KEY,
    CRC32_KEY,
    FORMAT_VERSION,
    SNAPSHOT_NAMES,
    SnapshotParts,
    ViewSpec,
    collect_storages,
    rebuild_views,
    record_name,
    register_snapshot_leaf,
    resolve_leaf_class,
    resolve_record,
    storage_bytes,
)
from sessionstate._storage._hostpool import HostBufferPool, HostPoolFullError
from sessionstate._storage._inspect import inspect_snapshot
from sessionstate._storage._movers import to_device
from sessionstate._storage._park import (
    TIERS,
    ParkedBytes,
    SpoolDir,
    Tier,
    check_tier,
    is_engine_leaf,
    is_offloadable,
    park_tree,
    reclaim_spool,
)

__all__ = [
    "CHECKSUM_KEY",
    "CRC32_KEY",
    "FORMAT_VERSION",
    "SNAPSHOT_NAMES",
    "TIERS",
    "HostBufferPool",
    "HostPoolFullError",
    "ParkedBytes",
    "SnapshotParts",
    "SpoolDir",
    "Tier",
    "ViewSpec",
    "check_tier",
    "collect_storages",
    "dumps_parts",
    "dumps_state",
    "inspect_snapshot",
    "is_engine_leaf",
    "is_offloadable",
    "load_state",
    "loads_parts",
    "loads_state",
    "park_tree",
    "read_header",
    "rebuild_views",
    "reclaim_spool",
    "record_device",
    "record_name",
    "recorded_devices",
    "recording",
    "register_snapshot_leaf",
    "resolve_leaf_class",
    "resolve_record",
    "save_state",
    "storage_bytes",
    "to_device",
]
