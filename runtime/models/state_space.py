"""What Mamba and Mamba-2 (mamba.py, mamba2.py) share: a model of state-space layers only, each
x += mixer(attn_norm(x)) with no attention and no FFN, then the final norm and the head (tied to
the embeddings where the file has no output.weight). A mixer projects the normed input, runs a
causal convolution with a bias over part of it, and a selective scan (runtime/compute/selective_scan.py)
over a recurrent state that the cache holds (runtime/memory/recurrent_state.py, the state's shape a
ScanShape), gated by silu(z).
"""

from collections.abc import Callable
from functools import partial

import torch

from tierflow.errors import ModelFileError
from tierflow.runtime.compute import selective_scan
from tierflow.runtime.compute.interfaces import Activations, LayerPass, Weights, stack_rows
from tierflow.runtime.memory.recurrent_state import Recurrence
from tierflow.runtime.memory.state_shapes import ScanShape
from tierflow.runtime.models import tensor_map as tm
from tierflow.runtime.models.config import Metadata, ModelConfig, rope_scaling

Mixer = Callable[[LayerPass, Weights, Activations], Activations]  # normed x [T, E] -> [T, E]


def config(meta: Metadata, vocab_size: int, tied: bool, shape: ScanShape, inner: int) -> ModelConfig:
    """Every layer a state-space layer of `shape`. Attention's fields hold one nominal head that no
    layer reads (ModelConfig's checks ask for one); the FFN's width stands for the mixer's inner
    width in the activations' estimate."""
    return ModelConfig(
        arch=meta.arch, name=meta.text("general.name", meta.arch, general=True),
        num_layers=meta.count("block_count"), hidden_size=meta.count("embedding_length"), ffn_size=inner,
        num_heads=1, num_kv_heads=1, head_dim=2, vocab_size=vocab_size,
        context_length=meta.count("context_length", maximum=1 << 40),
        rms_norm_eps=meta.number("attention.layer_norm_rms_epsilon"), rope_theta=10000.0, rope_dim=2,
        rope_scaling=rope_scaling(meta), tied_embeddings=tied,
        recurrent_layers=(True,) * meta.count("block_count"), recurrent=shape)


def sizes(meta: Metadata) -> tuple[int, int, int]:
    """ssm.conv_kernel, ssm.inner_size and ssm.state_size."""
    return (meta.count("ssm.conv_kernel", minimum=2, maximum=64), meta.count("ssm.inner_size"),
            meta.count("ssm.state_size"))


def divides(meta: Metadata, part: str, whole: str) -> int:
    """{arch}.{whole} / {arch}.{part}, which must divide it (a ModelFileError naming both)."""
    a, b = meta.count(part), meta.count(whole)
    if b % a:
        raise ModelFileError(f"metadata '{meta.arch}.{whole}' {b} is not a multiple of "
                             f"'{meta.arch}.{part}' {a}")
    return b // a


def mixer_fields(config: ModelConfig, layer: int, inner: int, projected: int) -> list[tm.Field]:
    """The fields both mixers have: the norm, the in-projection (`projected` wide), the convolution
    and its bias, the out-projection from `inner` channels."""
    e, s, p = config.hidden_size, config.recurrent, f"blk.{layer}."
    return [tm.vector("attn_norm", p + "attn_norm.weight", (e,), "attention"),
            tm.matmul("ssm_in", [(p + "ssm_in.weight", (e, projected))], "attention"),
            tm.vector("ssm_conv1d", p + "ssm_conv1d.weight", (s.conv_kernel, s.conv_channels), "attention"),
            tm.vector("ssm_conv1d_bias", p + "ssm_conv1d.bias", (s.conv_channels,), "attention"),
            tm.matmul("ssm_out", [(p + "ssm_out.weight", (inner, e))], "attention")]


def block(x: Activations, w: Weights, p: LayerPass, mixer: Mixer) -> Activations:
    """x + mixer(norm(x)), in place."""
    x += p.kernels.take(mixer(p, w, p.kernels.rms_norm(x, w.attn_norm, p.config.rms_norm_eps)))
    return x


def scan(p: LayerPass, w: Weights, conv_in: torch.Tensor, gates: tuple[torch.Tensor, ...],
         inputs: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], a: torch.Tensor) -> torch.Tensor:
    """Each sequence's scan over its tokens: conv_in [T, C] before the convolution, `gates` [T, ...]
    each (Mamba-2's time steps), `inputs` the convolution's outputs -> x [T, H, P] and what else the
    scan reads, a [H, 1, N or 1] -> y [T, H, P]. A and D are copied: replays outlive the weights."""
    s = p.config.recurrent
    conv_weight = torch.as_tensor(w.ssm_conv1d).reshape(s.conv_channels, s.conv_kernel)
    d = torch.as_tensor(w.ssm_d).reshape(s.heads).clone()
    a = a.clone()
    recurrence = Recurrence(conv_weight, torch.as_tensor(w.ssm_conv1d_bias), inputs,
                            partial(selective_scan.steps, a, d), partial(selective_scan.long_pass, a, d))
    return stack_rows([seq.recurrent(conv_in[seq.rows], tuple(g[seq.rows] for g in gates), recurrence)
                       for seq in p.sequences])
