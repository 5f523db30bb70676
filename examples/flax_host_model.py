"""Put sink-aware attention into your own Flax NNX model and add the CV^2 load-balancing loss ([Sink-MoE] eq. 7).

Run: python examples/flax_host_model.py
The model below is yours (not from sinkjax); only the attention layer, `pop_head_importance` and the losses are
imported. Every `Attention` call records its per-head importance with `nnx.sow`; after the forward pass,
`pop_head_importance(model)` returns them as an [L, H] array (layer order) and removes them from the model.
"""
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sinkjax.balance import aux_loss, head_imbalance
from sinkjax.layers import Attention, pop_head_importance


class MyLM(nnx.Module):
  def __init__(self, vocab: int, d: int, heads: int, layers: int, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.attn = nnx.List([Attention(d, heads, attention="sink", rngs=rngs) for _ in range(layers)])
    self.mlp = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(layers)])
    self.out = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, tokens, segment_ids=None):
    x = self.embed(tokens)
    for attn, mlp in zip(self.attn, self.mlp):
      x = x + attn(x, segment_ids=segment_ids)
      x = x + jax.nn.gelu(mlp(x))
    return self.out(x)


def main(steps: int = 60, aux_weight: float = 1e-2):
  model = MyLM(vocab=32, d=64, heads=4, layers=2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, tokens):
    def loss_fn(model):
      logits = model(tokens[:, :-1])
      lm = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      imp = pop_head_importance(model)                    # [layers, heads]
      aux = aux_loss(imp, weight=aux_weight)              # eq. 7; num_shared=m gives eq. 8
      return lm + aux, (lm, head_imbalance(imp))
    (_, (lm, hi)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return lm, hi

  key = jax.random.PRNGKey(1)
  for step in range(steps):
    key, sub = jax.random.split(key)
    start = jax.random.randint(sub, (16, 1), 0, 32)
    tokens = (start + jnp.arange(33)[None] * 3) % 32      # a learnable arithmetic sequence
    lm, hi = train_step(model, optimizer, tokens)
    if step % 10 == 0 or step == steps - 1:
      print(f"step {step:3d}  lm loss {float(lm):.3f}  head imbalance {float(hi):.3f}")


if __name__ == "__main__":
  main()
