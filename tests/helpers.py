"""Helpers shared by several test files: independent references that the tests compare the code against, and the
commands run in subprocesses."""
import contextlib
import os
import pathlib
import subprocess
import sys

import numpy as np

from sinkjax.config import ModelConfig
from sinkjax.run import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


@contextlib.contextmanager
def compile_only_gpu(device_kind: str = "NVIDIA H100 80GB HBM3", num_cores: int = 132):
  """Traces under an abstract mesh of one compile-only NVIDIA GPU, so that `.lower(lowering_platforms=("cuda",))`
  works on a CPU host: the Pallas GPU call registrations ask the mesh's abstract device (jax >= 0.12 raises "No
  supported GPU devices found" without one) and sinkjax's `target_platform()` answers "gpu"."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import AbstractDevice, AbstractMesh  # pylint: disable=import-outside-toplevel
  device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="cuda")
  with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
    yield


# ---------------------------------------------------------------------------------------------------------------
# References, written out independently of sinkjax in float64 numpy
# ---------------------------------------------------------------------------------------------------------------

def rms_norm(x, eps=1e-6):
  """Parameter-free RMS norm over the last axis."""
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def rope(x, pos, theta=10000.0):
  """Split-halves RoPE: pairs (x_i, x_{i+D/2}) rotated by pos * theta^(-2i/D); x [..., T, H, D], pos [..., T]."""
  d = x.shape[-1]
  ang = np.asarray(pos, np.float64)[..., None, None] * theta ** -(np.arange(0, d, 2) / d)     # [..., T, 1, D/2]
  a, b = x[..., :d // 2], x[..., d // 2:]
  return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)


def param_count_formula(cfg: ModelConfig) -> int:
  """Closed-form parameter count of `sinkjax.model.Transformer` for a config, written out from the architecture."""
  d, hq, hkv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  v = -(-cfg.vocab_size // cfg.vocab_pad_to) * cfg.vocab_pad_to        # embedding / LM-head rows, padded
  attn = d * hq * hd + 2 * d * hkv * hd + hq * hd * d
  if cfg.attention == "sink":
    attn += hq
  attn += cfg.sink_tokens * d              # learnable sink tokens (sink_states of each layer)
  if cfg.attention == "gated":            # gate heads: Hq at G1, Hkv at G2, 1 head-shared
    gh = 1 if cfg.gate_shared else (hq if cfg.gate_position == "sdpa" else hkv)
    w = gh if cfg.gate == "headwise" else gh * hd
    attn += (d * w + (w if cfg.gate_bias else 0)) if cfg.gate_input == "dependent" else w
  if cfg.attn_bias:                        # q/k/v biases, o_proj's with attn_out_bias
    attn += hq * hd + 2 * hkv * hd + (d if cfg.attn_out_bias else 0)
  if cfg.norm_scale and cfg.qk_norm:
    attn += 2 * hd
  # Gated DeltaNet ("linear" layers): in_proj_qkvz, in_proj_ba, the depthwise conv over q/k/v, dt_bias, A_log, the
  # gated norm's scale, out_proj.
  kh, vh = cfg.linear_key_heads or hq, cfg.linear_value_heads or hq
  kd, vd = kh * (cfg.linear_key_head_dim or hd), vh * (cfg.linear_value_head_dim or hd)
  linear = d * (2 * kd + 2 * vd) + d * 2 * vh + cfg.linear_conv_kernel * (2 * kd + vd) + 2 * vh + \
      (cfg.linear_value_head_dim or hd) + vd * d
  norms = 2 * d if cfg.norm_scale else 0   # attention/MLP norms per block; final norm below
  h = cfg.mlp_width
  gated = cfg.mlp != "relu2"
  mlp = (3 if gated else 2) * d * h + (((2 if gated else 1) * h + d) if cfg.mlp_bias else 0)
  if cfg.moe_experts:                      # experts + router (its bias with topk_softmax) + a shared expert
    mlp = cfg.moe_experts * mlp + d * cfg.moe_experts + (cfg.moe_experts if cfg.moe_router == "topk_softmax" else 0)
    mlp += (3 * d * cfg.moe_shared_hidden + d) if cfg.moe_shared_hidden else 0
  kinds = cfg.layer_types or ["full"] * cfg.num_layers
  final = (d if cfg.norm_scale else 0) + (2 * cfg.num_layers if cfg.residual_scalars else 0)
  return v * d * (1 if cfg.tie_embeddings else 2) + sum((linear if k == "linear" else attn) + norms + mlp
                                                        for k in kinds) + final


# ---------------------------------------------------------------------------------------------------------------
# Commands in subprocesses
# ---------------------------------------------------------------------------------------------------------------

def command_env(extra=None, devices: int = 1) -> dict:
  """A command's environment: this process' on `devices` CPU devices (the test session simulates 8, which makes
  every compile of a one-device run slower), plus `extra`."""
  return {**os.environ, "JAX_PLATFORMS": "cpu", **(extra or {}),
          "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def start_command(module: str, *args, env=None, devices: int = 1, cwd=ROOT, **popen) -> subprocess.Popen:
  """`python -m MODULE ARGS...` started in a subprocess, its stdout and stderr piped as text."""
  return subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=command_env(env, devices),
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def finish(proc: subprocess.Popen, timeout: float = 600) -> subprocess.CompletedProcess:
  """Waits for a started command; its status and output."""
  out, err = proc.communicate(timeout=timeout)
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_command(module: str, *args, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
  """`python -m MODULE ARGS...` run to its end in a subprocess (`start_command`'s keywords)."""
  return finish(start_command(module, *args, **kw), timeout)


def call_main(main, argv, capsys) -> subprocess.CompletedProcess:
  """A command's `main(argv)` called in this process, its status and output (captured by pytest's capsys) as
  `finish` gives them for a subprocess: for the user-error cases of a command, which fail before any compile, at a
  fraction of a subprocess's start-up (importing JAX and sinkjax: seconds of CPU each)."""
  capsys.readouterr()
  try:
    status = main(list(map(str, argv)))
  except SystemExit as e:                  # argparse's errors and --help
    status = e.code
  out = capsys.readouterr()
  return subprocess.CompletedProcess(list(argv), status, out.out, out.err)


def one_error_line(result: subprocess.CompletedProcess, status: int = 1) -> str:
  """The one line on stderr of a command that failed with `status` (no traceback, nothing else)."""
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert result.returncode == status, (result.returncode, result.stdout[-3000:], result.stderr[-3000:])
  assert len(lines) == 1, result.stderr[-3000:]
  return lines[0]


def losses(run_dir) -> list[tuple[int, float]]:
  """(step, loss) of each record in RUN_DIR/metrics.jsonl; [] before the first is written."""
  path = pathlib.Path(run_dir) / "metrics.jsonl"
  return [(r["step"], r["loss"]) for r in read_metrics(path)] if path.is_file() else []


def run_ok(module: str, *args, **kw) -> subprocess.CompletedProcess:
  """`run_command` that must succeed (its output in the failure message)."""
  r = run_command(module, *args, **kw)
  assert r.returncode == 0, f"{module} {' '.join(map(str, args))} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
  return r


def randomize_hf_weights(model) -> None:
  """A transformers model's weights drawn at test scale (norm scales near 1, matrices 0.2, vectors 0.5 standard
  deviations), so that every parameter matters in a logit comparison."""
  import torch  # the oracle extra; only the tests against transformers call this
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
      else:
        p.copy_((0.2 if p.ndim > 1 else 0.5) * torch.randn_like(p))
