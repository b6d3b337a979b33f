"""The least-squares start (swiftkv/least_squares_init.py): it recovers an exact linear relation, beats
the copy start on tokens it was not fitted on, fits biases where the family has them, and refuses
families whose K/V are not k_proj/v_proj."""

from __future__ import annotations

import pytest
import torch

from swiftkv.convert import convert_model
from swiftkv.least_squares_init import fit_swiftkv_kv
from tests.tiny import save_tiny_base


def _rows(count: int = 10, length: int = 48, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 200, (1, length), generator=gen),
             "position_ids": torch.arange(length)[None]} for _ in range(count)]


def test_at_the_last_layer_the_fit_is_the_copy(tmp_path):
    """At c = L - 1 the only SwiftKV layer reads exactly its own input through the copied norm: the
    teacher's K/V are linear in it, so the fit explains them whole and equals the copy."""
    base = save_tiny_base(tmp_path, "llama", num_hidden_layers=4)
    model = convert_model(base, num_key_value_layers=3)
    fit = fit_swiftkv_kv(model, _rows(), ridge=1e-9)
    assert set(fit.r2) == {"k3", "v3"}
    assert min(fit.r2.values()) > 0.999 and min(fit.copy_r2.values()) > 0.999
    for kind in ("k", "v"):
        torch.testing.assert_close(fit.tensors[f"model.layers.3.self_attn.{kind}_proj_swiftkv.weight"],
                                   getattr(base.model.layers[3].self_attn, f"{kind}_proj").weight,
                                   rtol=0, atol=1e-3)
    assert not model.config.swiftkv  # left as the teacher


@pytest.mark.parametrize("family, group", [("llama", 1), ("llama", 2), ("qwen2", 1), ("qwen3", 1)])
def test_the_fit_beats_the_copy_on_held_out_tokens(family, group, tmp_path):
    base = save_tiny_base(tmp_path, family, num_hidden_layers=6)
    model = convert_model(base, num_key_value_layers=2, key_value_group_size=group)
    fit = fit_swiftkv_kv(model, _rows(count=15))
    leaders = range(2, 6, group)
    assert set(fit.r2) == {f"{kind}{j}" for j in leaders for kind in ("k", "v")}
    # Layer c reads its own input through the copied norm: the copy is exact there (g = 1), the fit too.
    exact = {"k2", "v2"} if group == 1 else set()
    assert all(fit.r2[name] > 0.9999 for name in exact)
    assert all(fit.r2[name] > fit.copy_r2[name] for name in set(fit.r2) - exact), (fit.r2, fit.copy_r2)
    assert fit.heldout_tokens == 3 * 48 and fit.fit_tokens == 12 * 48  # every fifth row held out
    biases = {name for name in fit.tensors if name.endswith(".bias")}
    assert bool(biases) == (family == "qwen2")
    ids = torch.randint(3, 200, (1, 20))
    before = model.swiftkv(True)(ids).logits
    result = model.load_state_dict(fit.tensors, strict=False)  # the keys are the checkpoint's own
    assert not result.unexpected_keys
    assert not torch.equal(model(ids).logits, before)


def test_families_with_other_kv_modules_are_refused(tmp_path):
    base = save_tiny_base(tmp_path, "deepseek_v2", num_hidden_layers=4)
    with pytest.raises(ValueError, match="k_proj/v_proj"):
        fit_swiftkv_kv(convert_model(base, num_key_value_layers=2), _rows())


def test_too_few_rows_to_hold_any_out_are_refused(tmp_path):
    model = convert_model(save_tiny_base(tmp_path, "llama", num_hidden_layers=4), num_key_value_layers=2)
    with pytest.raises(ValueError, match="at least 5 calibration rows"):
        fit_swiftkv_kv(model, _rows(count=3))
