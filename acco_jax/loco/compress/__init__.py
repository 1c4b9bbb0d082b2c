"""Compression of what workers send each other (pure ``jax.numpy``; no collectives).

* :mod:`~acco_jax.loco.compress.fp4`: FP4 E3M0 with power-of-two block scales (Streaming DiLoCo),
  an emulated :class:`Compressor` that quantises and dequantises a dense payload.
* :mod:`~acco_jax.loco.compress.sparse`: chunks of a device's shard (2-D tiles or 1-D chunks),
  top-k per chunk, the orthonormal DCT-II, the deterministic scatter-mean, and the
  :class:`SparseCodec` that turns a payload into packed bytes and a set of them back into a mean
  (SparseLoCo, DeMo).
* :mod:`~acco_jax.loco.compress.bits`: the 2/4/8-bit quantiser with a per-tensor shift and lookup
  table, 12-bit index packing and code packing.
"""

from acco_jax.loco.compress.bits import dequantize as dequantize
from acco_jax.loco.compress.bits import pack12 as pack12
from acco_jax.loco.compress.bits import pack_codes as pack_codes
from acco_jax.loco.compress.bits import quantize as quantize
from acco_jax.loco.compress.bits import unpack12 as unpack12
from acco_jax.loco.compress.bits import unpack_codes as unpack_codes
from acco_jax.loco.compress.fp4 import E3M0_LEVELS as E3M0_LEVELS
from acco_jax.loco.compress.fp4 import SCALE_BITS as SCALE_BITS
from acco_jax.loco.compress.fp4 import Compressor as Compressor
from acco_jax.loco.compress.fp4 import block_scales as block_scales
from acco_jax.loco.compress.fp4 import e3m0 as e3m0
from acco_jax.loco.compress.fp4 import fp4_payload_bytes as fp4_payload_bytes
from acco_jax.loco.compress.fp4 import fp4_roundtrip as fp4_roundtrip
from acco_jax.loco.compress.fp4 import get_compressor as get_compressor
from acco_jax.loco.compress.fp4 import levels as levels
from acco_jax.loco.compress.sparse import ChunkPlan as ChunkPlan
from acco_jax.loco.compress.sparse import SparseCodec as SparseCodec
from acco_jax.loco.compress.sparse import dct_basis as dct_basis
from acco_jax.loco.compress.sparse import from_chunks as from_chunks
from acco_jax.loco.compress.sparse import plan_chunks as plan_chunks
from acco_jax.loco.compress.sparse import scatter as scatter
from acco_jax.loco.compress.sparse import scatter_mean as scatter_mean
from acco_jax.loco.compress.sparse import to_chunks as to_chunks
from acco_jax.loco.compress.sparse import topk as topk
