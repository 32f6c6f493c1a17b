"""K/V state: encode-once per-layer K/V, and the engine-owned paged pool with its handles.

`EncodeOnceKV` and `KVPair` are a state object's K/V, computed once per session; `KVPool` and
`KVHandle` are an engine's paged KV cache, of which a record holds immutable handles (and
whose snapshot and offload codecs live with the pool, the one module that touches its
blocks); `KVCache` is the state object a record holds a handle in, so the manager can park it,
and `GatheredKV` what stands in for the handle while the record is in a batch.
"""

from sessionstate._kv._cache import GatheredKV, KVCache
from sessionstate._kv._encode_once import EncodeOnceKV, KVPair
from sessionstate._kv._pool import KVHandle, KVPool

__all__ = ["EncodeOnceKV", "GatheredKV", "KVCache", "KVHandle", "KVPair", "KVPool"]
