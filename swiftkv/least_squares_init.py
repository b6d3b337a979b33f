"""The least-squares start: each SwiftKV key/value projection fitted to the teacher's own K/V.

A SwiftKV layer ``j >= c`` reads its keys and values as linear maps of one input, ``x =
norm_swiftkv(h_c)``. The teacher's are ``K_j = k_proj_j(input_layernorm_j(h_j))`` (likewise V), so
the best linear start is the least-squares fit of ``K_j`` on ``x`` over calibration tokens: one
teacher pass over them and one small solve per projection, no backprop. The copy initialisation of
SPEC.md (layer j's own ``k_proj`` applied to ``x``) is one point of that space, often a poor one
(docs/distillation.md gives both fits' R² by cutoff). The held-out R² of the fit is also a ceiling:
no training of these weights can bring the student's K/V closer to the teacher's, in that sense, at
that cutoff.

The fit targets are taken before rotary (it is applied to both alike, at the same positions) and
before any per-head key norm (Qwen3's ``k_norm``, which the student keeps as ``k_norm_swiftkv``).
An AcrossKV group leader is fitted to the mean of its group's targets (what minimises the squared
error summed over the group). A family with attention biases (Qwen2) gets its bias fitted too. A
token-shift layer (config ``key_value_shift_layers``) is fitted on ``x`` of the token and of the
tokens before it side by side, its ``k/v_proj_swiftkv`` and ``k/v_shift_swiftkv`` in one solve.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from swiftkv.config import shift_layers
from swiftkv.modeling.attention import is_group_leader
from swiftkv.modeling.token_shift import shifted_states

log = logging.getLogger(__name__)

KINDS = ("k", "v")


@dataclass
class Moments:
    """Running sums over tokens of one data split: ``X^T X``, and per target ``X^T Y``, ``sum Y`` and
    ``sum Y^2`` (float64; ``X`` carries a column of ones last when a bias is fitted). Enough to solve
    a least-squares fit on one split and score it on another without keeping any token."""

    xtx: torch.Tensor
    xty: dict[str, torch.Tensor]
    y_sum: dict[str, torch.Tensor]
    y_sq: dict[str, float]
    tokens: int = 0

    @classmethod
    def empty(cls, width: int) -> Moments:
        return cls(torch.zeros(width, width, dtype=torch.float64), {}, {}, {})

    def add(self, x: torch.Tensor, targets: dict[str, torch.Tensor]) -> None:
        self.xtx += x.T @ x
        self.tokens += x.shape[0]
        for name, y in targets.items():
            self.xty[name] = self.xty.get(name, 0) + x.T @ y
            self.y_sum[name] = self.y_sum.get(name, 0) + y.sum(0)
            self.y_sq[name] = self.y_sq.get(name, 0.0) + float(y.pow(2).sum())

    def solve(self, name: str, ridge: float) -> torch.Tensor:
        """The least-squares weight ``[width, out]`` for target ``name``; ``ridge`` is added to the
        diagonal of ``X^T X`` relative to its mean diagonal."""
        width = self.xtx.shape[0]
        gram = self.xtx + ridge * self.xtx.diagonal().mean() * torch.eye(width, dtype=torch.float64)
        return torch.linalg.solve(gram, self.xty[name])

    def r2(self, name: str, weight: torch.Tensor) -> float:
        """R² of ``X @ weight`` against target ``name`` on this split, from its sums alone."""
        xty, xtx = self.xty[name], self.xtx
        sse = self.y_sq[name] - 2 * float((weight * xty).sum()) + float((weight * (xtx @ weight)).sum())
        sst = self.y_sq[name] - float(self.y_sum[name].pow(2).sum()) / self.tokens
        return 1.0 - sse / sst


@dataclass
class KVFit:
    """The fitted SwiftKV tensors and how well they fit."""

    tensors: dict[str, torch.Tensor]
    """State-dict entries (``model.layers.{j}.self_attn.{k,v}_proj_swiftkv.weight``, ``.bias``)."""
    r2: dict[str, float]
    """Held-out R² per fitted projection (``"k15"``, ``"v15"``, ...): the share of the teacher's K/V
    variance (about its mean, all dimensions pooled) the fit explains on tokens it was not fitted on."""
    copy_r2: dict[str, float]
    """The same R² for the weights the model held before the fit (the SPEC copy start, usually)."""
    fit_tokens: int
    heldout_tokens: int

    def summary(self) -> dict[str, float]:
        """Mean held-out R² of K and of V over the layers, before and after the fit."""
        out = {}
        for kind in KINDS:
            for label, r2 in (("least_squares", self.r2), ("before", self.copy_r2)):
                values = [v for k, v in r2.items() if k.startswith(kind)]
                out[f"{kind}_r2_{label}"] = sum(values) / len(values)
        return out


def capture_teacher_kv(model: nn.Module, c: int, kv_layers: range) -> tuple[dict[str, torch.Tensor], list]:
    """Forward hooks that keep the state entering layer ``c`` and each later layer's own K/V
    projection outputs (the teacher's), keyed ``"h"``, ``"k{j}"``, ``"v{j}"``."""
    seen: dict[str, torch.Tensor] = {}
    layers = model.get_decoder().layers

    def keep(name: str):
        return lambda _module, _inputs, output: seen.__setitem__(name, output.detach())

    handles = [layers[c].register_forward_pre_hook(
        lambda _module, args, kwargs: seen.__setitem__("h", (args[0] if args else kwargs["hidden_states"]).detach()),
        with_kwargs=True)]
    for j in kv_layers:
        for kind in KINDS:
            handles.append(getattr(layers[j].self_attn, f"{kind}_proj").register_forward_hook(keep(f"{kind}{j}")))
    return seen, handles


@torch.no_grad()
def fit_swiftkv_kv(
    model: nn.Module,
    rows: Iterable[dict[str, torch.Tensor]],
    heldout_every: int = 5,
    ridge: float = 1e-4,
) -> KVFit:
    """Fit every group leader's ``k/v_proj_swiftkv`` of the SwiftKV ``model`` to its teacher's K/V.

    ``rows``: dicts with ``input_ids`` and ``position_ids`` (``[1, T]`` or ``[B, T]``; packed rows
    with restarting positions are read as packed examples, as in training). Every ``heldout_every``-th
    row is kept out of the fit and scores it. ``ridge``: added to the diagonal of ``X^T X``, relative
    to its mean diagonal (the solve stays well posed when a few hundred tokens are given). The model
    is left unchanged (and in teacher mode); apply the result with ``load_state_dict(strict=False)``.
    """
    config = model.config
    c, g, n = config.num_key_value_layers, config.key_value_group_size, config.num_hidden_layers
    layers = model.get_decoder().layers
    if not all(hasattr(layers[c].self_attn, f"{kind}_proj_swiftkv") for kind in KINDS):
        raise ValueError(f"the least-squares start fits k_proj/v_proj attention; {type(layers[c].self_attn).__name__} "
                         "has other key/value modules (use the copy start)")
    leaders = [j for j in range(c, n) if is_group_leader(j, c, g)]
    shifted_layers = shift_layers(config)
    bias = layers[c].self_attn.k_proj.bias is not None
    # Two designs: x (every other leader) and [x, x of the tokens before] (the token-shift leaders).
    widths = {False: config.hidden_size, True: config.hidden_size * (1 + config.key_value_shift_tokens)}
    moments = {(split, shifted): Moments.empty(widths[shifted] + int(bias))
               for split in ("fit", "heldout") for shifted in {False, bool(shifted_layers)}}
    norm = model.get_decoder().norm_swiftkv
    model.swiftkv(False)
    seen, handles = capture_teacher_kv(model, c, range(c, n))
    try:
        for i, row in enumerate(rows):
            positions = row["position_ids"].long()
            model.get_decoder()(input_ids=row["input_ids"].long(), position_ids=positions, use_cache=False)
            normed = norm(seen["h"])
            designs = {False: normed}
            if shifted_layers:
                designs[True] = torch.cat(
                    [normed, shifted_states(normed, positions, config.key_value_shift_tokens)[0]], dim=-1)
            split = "heldout" if i % heldout_every == heldout_every - 1 else "fit"
            for shifted, x in designs.items():
                x = x.flatten(0, -2).double()
                if bias:
                    x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
                targets = {}
                for j in leaders:
                    if (j in shifted_layers) != shifted:
                        continue
                    for kind in KINDS:
                        group = [seen[f"{kind}{m}"].flatten(0, -2).double() for m in range(j, j + g)]
                        targets[f"{kind}{j}"] = torch.stack(group).mean(0)
                moments[(split, shifted)].add(x, targets)
    finally:
        for handle in handles:
            handle.remove()
    if moments[("fit", False)].tokens == 0 or moments[("heldout", False)].tokens == 0:
        raise ValueError(f"the least-squares start needs at least {heldout_every} calibration rows")
    tensors, r2, copy_r2 = {}, {}, {}
    hidden = config.hidden_size
    for j in leaders:
        attention, shifted = layers[j].self_attn, j in shifted_layers
        fit, heldout = moments[("fit", shifted)], moments[("heldout", shifted)]
        for kind in KINDS:
            name = f"{kind}{j}"
            solved = fit.solve(name, ridge)  # [width, out]: own token, tokens before, bias
            r2[name] = heldout.r2(name, solved)
            current = getattr(attention, f"{kind}_proj_swiftkv")
            before = [current.weight.detach().double().T]
            if shifted:
                before.append(getattr(attention, f"{kind}_shift_swiftkv").weight.detach().double().T)
            if bias:
                before.append(current.bias.detach().double()[None])
            copy_r2[name] = heldout.r2(name, torch.cat(before))
            prefix = f"model.layers.{j}.self_attn.{kind}"
            dtype = current.weight.dtype
            tensors[f"{prefix}_proj_swiftkv.weight"] = solved[:hidden].T.contiguous().to(dtype)
            if shifted:
                tensors[f"{prefix}_shift_swiftkv.weight"] = solved[hidden: widths[True]].T.contiguous().to(dtype)
            if bias:
                tensors[f"{prefix}_proj_swiftkv.bias"] = solved[-1].to(dtype)
    result = KVFit(tensors, r2, copy_r2, moments[("fit", False)].tokens, moments[("heldout", False)].tokens)
    log.info("least-squares K/V start at c=%d over %d tokens (%d held out): %s", c, result.fit_tokens,
             result.heldout_tokens, ", ".join(f"{k} {v:.3f}" for k, v in result.summary().items()))
    return result
