"""Named hook points (service/engine/adapters/points.py, service/engine/hooks.py) and the
conformance checks a family passes before it is registered (adapters/conformance.py).

An OPT-like family (learned positions added inline in the decoder's forward, post-norm, word
embeddings narrower than the blocks) whose adapter names the embedding module as ``embed`` once
passed ``register()`` and stored an attribution of 0.0 in every layer-0 row: it is now refused when
its plugin is loaded, in one line naming the failing check; the same family with ``embed`` and
``final_norm`` where its model computes them passes."""

from __future__ import annotations

import pytest
import torch
from test_plugins import temporary_plugin  # noqa: F401  (fixture)

from headatlas.service import plugins
from headatlas.service.engine.adapters import families, random_shape
from headatlas.service.engine.adapters.conformance import CHECKS, Failed, check, conform
from headatlas.service.engine.adapters.points import hook_names, parse_hook_name
from headatlas.service.engine.hooks import act_name, capture_attention, hooks
from headatlas.service.engine.model import load_model
from headatlas.service.errors import AdapterIncomplete

OPT_PLUGIN = '''
import torch

from headatlas.service.engine.adapters import ConfigKeys, ModelAdapter, RandomShape
from headatlas.service.engine.adapters.points import HookPoint


class OPTLikeAdapter(ModelAdapter):
    """OPT: post-norm decoder blocks decoder.layers[i]; the learned positions are added to the
    (projected) word embeddings inline in the decoder's forward, not by a module."""

    family = "opt_like"
    title = "OPT-like"
    model_types = ("opt",)
    causal = True
    pre_norm = False
    config_keys = ConfigKeys(intermediate="ffn_dim")
    random_shapes = {"opt_like": RandomShape("opt_like", 2, 4, 32)}

    def blocks(self, model):
        return list(model.decoder.layers)

    def attention(self, block):
        return block.self_attn

    def output_projection(self, block):
        return block.self_attn.out_proj

    def output_weight(self, block):
        return block.self_attn.out_proj.weight

    def values(self, block, x):
        attn = block.self_attn
        return attn.v_proj(x).view(*x.shape[:2], -1, attn.head_dim).transpose(1, 2)

    def embedding_output(self, model):
        return model.decoder.project_in  # the word embeddings only: the positions are added after it

    def attention_norm(self, block):
        return block.self_attn_layer_norm

    def final_norm(self, model):
        return None

    def random_config(self, shape, vocab_size):
        from transformers import OPTConfig

        return OPTConfig(
            vocab_size=vocab_size,
            hidden_size=shape.hidden,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            ffn_dim=4 * shape.hidden,
            word_embed_proj_dim=shape.hidden // 2,  # narrower than the blocks: project_in / project_out
            do_layer_norm_before=False,  # post-norm, and no final layer norm
            max_position_embeddings=64,
            attn_implementation="eager",
        )


class FixedOPTAdapter(OPTLikeAdapter):
    """The same family, its hook points where the model computes them: ``embed`` is what block 0
    receives (word embeddings plus positions exist nowhere else), and the decoder's output goes
    through project_out."""

    family = "opt_fixed"
    model_types = ("opt",)
    random_shapes = {"opt_fixed": RandomShape("opt_fixed", 2, 4, 32)}

    def final_norm(self, model):
        return model.decoder.project_out

    def hook_point(self, model, name):
        if name == "embed":
            return HookPoint(name, self.blocks(model)[0], "input")
        return super().hook_point(model, name)
'''


def _install_opt(temporary_plugin, entry: str) -> None:  # noqa: F811
    temporary_plugin("opt-plugin", {"headatlas.families": {"opt": f"opt_plugin:{entry}"}}, {"opt_plugin": OPT_PLUGIN})


def test_an_opt_like_family_that_names_the_wrong_embedding_is_refused_naming_the_check(temporary_plugin):  # noqa: F811
    _install_opt(temporary_plugin, "OPTLikeAdapter")
    listed = families()
    assert "opt_like" not in listed and random_shape("opt_like") is None
    (line,) = [f for f in plugins.failures() if "opt-plugin" in f]
    assert "\n" not in line
    assert line.startswith("headatlas: plugin opt (opt-plugin 0.1), headatlas.families = opt_plugin:OPTLikeAdapter")
    assert "AdapterIncomplete: model family 'opt_like' fails the conformance check 'embed'" in line
    assert "the embedding output (2x7x16) is not what block 0 receives (2x7x16)" in line  # no positions in it
    assert {"bert", "gpt2", "llama", "distilbert"} <= set(listed)  # everything else goes on working


def test_the_same_family_with_its_hook_points_where_the_model_computes_them_passes(temporary_plugin):  # noqa: F811
    _install_opt(temporary_plugin, "FixedOPTAdapter")
    adapter = families()["opt_fixed"]
    assert not [f for f in plugins.failures() if "opt-plugin" in f]
    model = load_model("random:opt_fixed", device="cpu")
    tokens = torch.tensor([[model.tokenizer.bos_token_id or 2, 10, 11, 12]])
    seen = {}
    with torch.no_grad(), hooks(model.model, {"embed": lambda e: seen.update(e=e)}):
        model.model(input_ids=tokens)
    assert seen["e"].shape == (1, 4, 32) and adapter.origin == "plugin opt (opt-plugin 0.1)"


@pytest.mark.parametrize("check_name", CHECKS)
def test_each_check_can_fail(check_name):
    """A family broken in one part fails that part's check by name (and passes the ones before)."""
    from headatlas.service.engine.adapters.gpt2 import GPT2Adapter

    class Broken(GPT2Adapter):
        pass

    broken = Broken()
    if check_name == "blocks":
        broken.blocks = lambda model: list(model.h)[:1]  # type: ignore[method-assign]
    elif check_name == "attn.pattern":
        broken.hook_point = _swap(broken, "attn.pattern", lambda m, n: _point(m, n, "blocks.0.attn.pattern"))
    elif check_name == "attn.z":
        broken.values = lambda block, x: GPT2Adapter.values(broken, block, x) * 2  # type: ignore[method-assign]
    elif check_name == "attn_out":
        broken.output_weight = lambda block: block.attn.c_proj.weight  # type: ignore[method-assign]  # not transposed
    elif check_name == "embed":
        broken.embedding_output = lambda model: model.wte  # type: ignore[method-assign]  # no positions
    elif check_name == "attention_norm":
        broken.attention_norm = lambda block: block.ln_2  # type: ignore[method-assign]
    elif check_name == "final_norm":
        broken.final_norm = lambda model: None  # type: ignore[method-assign]
    elif check_name == "unembed":
        broken.hook_point = _swap(broken, "unembed", lambda m, n: _point(m, n, f"blocks.{len(m.h) - 1}.resid_post"))
    with pytest.raises(AdapterIncomplete) as err:
        conform(broken)
    assert f"conformance check {check_name!r}" in str(err.value)


def _point(model, name, other):
    from headatlas.service.engine.adapters.gpt2 import GPT2Adapter
    from headatlas.service.engine.adapters.points import HookPoint

    found = GPT2Adapter().hook_point(model, other)
    return HookPoint(name, found.module, found.kind)


def _swap(adapter, suffix, where):
    default = adapter.hook_point

    def hook_point(model, name):
        return where(model, name) if name.endswith(suffix) and name != "blocks.0.attn.pattern" else default(model, name)

    return hook_point


def test_every_family_passes_the_conformance_checks_on_its_tiny_model():
    for adapter in families().values():
        conform(adapter)  # AdapterIncomplete naming the check otherwise


def test_hook_point_names():
    names = hook_names(2)
    assert names[0] == "embed" and names[-1] == "unembed"
    for layer in (0, 1):
        for part in ("resid_pre", "attn.pattern", "attn.z"):
            assert f"blocks.{layer}.{part}" in names
    assert parse_hook_name("blocks.12.attn.z") == (12, "attn.z")
    assert act_name("z", 1) == "blocks.1.attn.z" and act_name("pattern", 0) == "blocks.0.attn.pattern"
    for bad in ("blocks.0.attn.q", "blocks.x.resid_pre", "embeddings"):
        with pytest.raises(ValueError, match="unknown hook point"):
            parse_hook_name(bad)


def test_a_replaced_z_changes_the_output_as_a_zero_head_does(tiny_model):
    """Intervention through a name: z of head 1 of layer 0 set to zero at ``blocks.0.attn.z`` is
    the model with that head's W_O columns zeroed (BERT takes z as the self-attention returns it)."""
    model, adapter = tiny_model.model, tiny_model.adapter
    d = tiny_model.d_head
    ids = torch.tensor([[101, 2000, 2001, 2002, 102]])

    def zero_head(z):
        z = z.clone()
        z[..., d : 2 * d] = 0
        return z

    with torch.no_grad():
        intact = model(input_ids=ids).last_hidden_state
        with hooks(model, {"blocks.0.attn.z": zero_head}):
            edited = model(input_ids=ids).last_hidden_state
        proj = adapter.output_projection(adapter.blocks(model)[0])
        saved = proj.weight.clone()
        proj.weight[:, d : 2 * d] = 0
        try:
            expected = model(input_ids=ids).last_hidden_state
        finally:
            proj.weight.copy_(saved)
    assert not torch.allclose(edited, intact)
    torch.testing.assert_close(edited, expected)


def _ours(model) -> int:
    """Hooks of ours anywhere in ``model`` (transformers adds its own to record attentions)."""
    hooks_of = lambda m: [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]  # noqa: E731
    return sum("HookPoint" in getattr(fn, "__qualname__", "") for m in model.modules() for fn in hooks_of(m))


def test_capture_is_the_hook_points_values_and_leaves_no_hook(tiny_model):
    model = tiny_model.model
    ids = torch.tensor([[101, 2000, 2001, 102]])
    seen = {}
    assert _ours(model) == 0
    with torch.no_grad(), capture_attention(model) as acts, hooks(model, {"unembed": lambda u: seen.update(u=u)}):
        assert _ours(model) == 2 * 2 + 1  # z and pattern of 2 layers, and unembed
        out = model(input_ids=ids, output_attentions=True)
    assert torch.equal(acts["blocks.1.attn.pattern"], out.attentions[1])
    assert torch.equal(seen["u"], out.last_hidden_state)
    assert _ours(model) == 0


def test_check_runs_on_real_windows_of_the_default_model(tiny_model):
    """The same checks the registration runs, on the session's model and a padded batch."""
    ids = torch.tensor([[101, 2000, 2001, 2002, 102], [101, 2003, 102, 0, 0]])
    mask = (ids != 0).long()
    check(tiny_model.adapter, tiny_model.model, ids, mask)
    with pytest.raises(Failed, match="attn_out"):
        from headatlas.service.engine.adapters.bert import BertAdapter

        class WrongWeight(BertAdapter):
            def output_weight(self, block):
                return block.attention.output.dense.weight * 1.5

        check(WrongWeight(), tiny_model.model, ids, mask)


def test_a_family_registered_directly_is_held_to_the_same_checks():
    """``register()`` called by hand (no entry point) runs the conformance checks too: the OPT-like
    family is refused naming the check, and nothing of it is registered."""
    from headatlas.service.engine.adapters.base import register

    namespace: dict = {}
    exec(compile(OPT_PLUGIN, "opt_direct", "exec"), namespace)
    adapter = namespace["OPTLikeAdapter"]
    adapter.__module__ = "opt_direct"
    with pytest.raises(AdapterIncomplete, match="fails the conformance check 'embed'"):
        register(adapter)
    assert "opt_like" not in families() and random_shape("opt_like") is None
