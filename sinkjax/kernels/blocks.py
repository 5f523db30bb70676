"""`BlockSizes`: the tiles of the three passes of flash attention (forward, dK/dV, dQ), each with its own best size.

Field names follow JAX's own Pallas GPU attention (`jax.experimental.pallas.ops.gpu.attention.BlockSizes`). A field
left None takes the backend's default for that pass (`DEFAULT_BLOCK_SIZES` in each backend module), so
`BlockSizes(block_q_dq=32)` changes only the dQ pass's query tile.

Which backend reads which field:
  pallas_gpu  forward (block_q, block_k); dK/dV (block_q_dkv, block_kv_dkv); dQ (block_q_dq, block_kv_dq).
              Powers of two; each is raised to 16 (Triton's smallest dot) and capped at the padded sequence.
  pallas_tpu  the same six; each is rounded up to a multiple of 128 and capped at the sequence rounded up to 128.
  xla         forward (block_q, block_k); backward (block_q_dkv, block_kv_dkv): one fused scan over key blocks
              yields dK, dV and dQ. Queries are tiled only for causal attention (to skip the masked tiles);
              block_q_dq and block_kv_dq are ignored.
"""
from __future__ import annotations

import dataclasses
import numbers


def check_tile(name: str, value) -> None:
  """A tile is None (backend default) or a positive int; anything else is the caller's error, named as `name`."""
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
    raise ValueError(f"{name} must be a positive integer (or None for the backend default); got {value!r}")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes per pass; None = the backend's default. Hashable, so it can be a static argument of `jax.jit`."""
  block_q: int | None = None         # forward: query rows per tile
  block_k: int | None = None         # forward: keys per tile
  block_q_dkv: int | None = None     # dK/dV pass: query rows per tile
  block_kv_dkv: int | None = None    # dK/dV pass: keys per tile
  block_q_dq: int | None = None      # dQ pass: query rows per tile
  block_kv_dq: int | None = None     # dQ pass: keys per tile

  def __post_init__(self):
    for f in dataclasses.fields(self):
      check_tile(f"block_sizes.{f.name}", getattr(self, f.name))

  @classmethod
  def uniform(cls, block_q: int | None = None, block_k: int | None = None) -> BlockSizes:
    """One (query, key) tile for all three passes: what `flash_attention(block_q=, block_k=)` means."""
    return cls(block_q, block_k, block_q, block_k, block_q, block_k)

  def or_defaults(self, defaults: BlockSizes) -> BlockSizes:
    """These sizes with every None taken from `defaults`."""
    return BlockSizes(**{f.name: getattr(defaults, f.name) if getattr(self, f.name) is None else getattr(self, f.name)
                         for f in dataclasses.fields(self)})

  @property
  def fwd(self) -> tuple:
    return self.block_q, self.block_k

  @property
  def dkv(self) -> tuple:
    return self.block_q_dkv, self.block_kv_dkv

  @property
  def dq(self) -> tuple:
    return self.block_q_dq, self.block_kv_dq


def visible_tiles(nq: int, nk: int, bq: int, bk: int, offset: int, causal: bool) -> int:
  """How many (query block, key block) tiles of an nq x nk grid a kernel computes: all of them, or under causal
  masking (bottom-right aligned, query t sees key s <= t + offset) those with at least one visible key (tile (i, j)
  when j * bk <= i * bq + bq - 1 + offset). What the kernels' `pl.CostEstimate` counts."""
  if not causal:
    return nq * nk
  return sum(min(nk, max(0, (i * bq + bq - 1 + offset) // bk + 1)) for i in range(nq))
