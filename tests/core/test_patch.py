"""Patch primitives: every mutation is undone exactly (identity, not equality), in reverse order."""

from __future__ import annotations

import pytest
import torch

from hfpatch.core.patch import ABSENT, Patch, PatchError


def _snapshot(module: torch.nn.Module) -> dict[str, dict]:
    """vars() of every submodule plus its parameter/buffer/module stores, by identity."""
    snap = {}
    for name, sub in module.named_modules():
        entries = dict(vars(sub))
        for store in ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks"):
            entries[store + "_items"] = dict(getattr(sub, store))
        snap[name] = entries
    return snap


def _assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].keys() == after[name].keys(), f"{name}: keys differ"
        for key, value in before[name].items():
            if isinstance(value, dict):
                assert value.keys() == after[name][key].keys(), f"{name}.{key}"
                assert all(value[k] is after[name][key][k] for k in value), f"{name}.{key}: objects differ"
            else:
                assert after[name][key] is value, f"{name}.{key}: not the same object"


def test_set_attr_on_plain_object_restores_absent_and_old_values():
    class Obj:
        existing = "class-level"

    obj = Obj()
    obj.mine = original = object()
    patch = Patch("t")
    patch.set_attr(obj, "mine", "new")
    patch.set_attr(obj, "existing", "instance")  # shadows the class attribute
    patch.set_attr(obj, "added", 1)
    assert (obj.mine, obj.existing, obj.added) == ("new", "instance", 1)
    patch.remove()
    assert obj.mine is original
    assert "existing" not in vars(obj) and obj.existing == "class-level"
    assert not hasattr(obj, "added")


def test_module_primitives_remove_restores_identity_of_every_store():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    model[0].register_forward_hook(lambda m, i, o: None)  # a user's own hook must survive
    before = _snapshot(model)
    x = torch.randn(4, 3)
    expected = model(x)

    patch = Patch("t")
    patch.wrap_method(model[0], "forward", lambda orig: lambda inp: orig(inp) * 0)
    patch.set_attr(model, "2", torch.nn.Linear(3, 2))  # replaces a submodule
    patch.set_attr(model[2], "weight", torch.nn.Parameter(torch.zeros(2, 3)))
    patch.add_forward_pre_hook(model, lambda m, args, kwargs: ((args[0] + 1,), kwargs))
    patch.add_forward_hook(model, lambda m, args, kwargs, out: out + 1)
    freed = []
    patch.on_remove(model, "cache", lambda: freed.append(True))
    assert not torch.equal(model(x), expected)
    assert "Linear" in patch.describe() and "forward" in patch.describe()

    patch.remove()
    _assert_same(before, _snapshot(model))
    assert torch.equal(model(x), expected)
    assert freed == [True]


def test_remove_is_idempotent_and_patch_is_dead_afterwards():
    layer = torch.nn.Linear(2, 2)
    patch = Patch("t")
    patch.set_attr(layer, "x", 1)
    patch.remove()
    patch.remove()
    assert not patch.is_active
    with pytest.raises(PatchError, match="was removed"):
        patch.set_attr(layer, "x", 2)


def test_context_manager_removes_on_exception():
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="boom"):
        with Patch("t") as patch:
            patch.set_attr(layer, "flag", True)
            raise RuntimeError("boom")
    assert not hasattr(layer, "flag")


def test_swap_processor_requires_processor_attribute():
    with pytest.raises(PatchError, match="no attention processor"):
        Patch("t").swap_processor(torch.nn.Linear(2, 2), object())


def test_children_are_undone_at_their_place_in_the_log():
    """Regression: a pipeline patch that wraps what a component patch wrapped must be undone first."""
    layer = torch.nn.Linear(2, 2)
    original = layer.forward
    order = []
    parent, child = Patch("parent"), Patch("child")
    parent.on_remove(layer, "parent-before", lambda: order.append("parent-before"))
    parent.add_child(child)
    child.wrap_method(layer, "forward", lambda orig: lambda x: orig(x) + 1)
    child.on_remove(layer, "child-step", lambda: order.append("child"))
    parent.wrap_method(layer, "forward", lambda orig: lambda x: orig(x) * 2)  # wraps the child's wrapper
    parent.on_remove(layer, "parent-after", lambda: order.append("parent-after"))
    text = parent.describe()
    assert "parent-after" in text and "child: Linear" in text
    parent.remove()
    assert order == ["parent-after", "child", "parent-before"]
    assert "forward" not in vars(layer) and layer.forward == original


def test_absent_marker_is_a_singleton():
    assert type(ABSENT)() is ABSENT and repr(ABSENT) == "ABSENT"


def test_remove_under_a_later_accelerate_hook_keeps_the_hook_and_drops_the_patch():
    # CPU offload / device_map: accelerate wraps module.forward after hfpatch did and keeps the wrapped one in
    # _old_forward. Removing the patch must unwrap only hfpatch's layer.
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    layer, x = torch.nn.Linear(2, 2), torch.randn(3, 2)
    expected = layer(x)
    patch = Patch("layer")
    patch.wrap_method(layer, "forward", lambda original: lambda inputs: original(inputs) * 2)
    add_hook_to_module(layer, Counting())
    assert torch.equal(layer(x), expected * 2) and Counting.calls == 1
    patch.remove()
    assert torch.equal(layer(x), expected) and Counting.calls == 2, "the hook stays, the patch is gone"
    remove_hook_from_module(layer)
    # accelerate puts back what _old_forward holds: the stock method, not hfpatch's wrapper.
    assert layer.forward.__func__ is torch.nn.Linear.forward and torch.equal(layer(x), expected)


def test_remove_after_the_attribute_was_replaced_warns_and_restores():
    class Holder:
        value = "class"

    holder = Holder()
    holder.value = "before"
    patch = Patch("holder")
    patch.set_attr(holder, "value", "patched")
    holder.value = "later"
    with pytest.warns(UserWarning, match=r"Holder.*\.value was replaced after hfpatch.apply"):
        patch.remove()
    assert holder.value == "before"


def test_wrap_forward_under_accelerate_hook_survives_hook_reinstall_and_removes_cleanly():
    # diffusers' enable_model_cpu_offload re-installs the hooks after every pipeline call
    # (maybe_free_model_hooks: remove_hook_from_module + add_hook_to_module); the patch must stay active.
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    layer, x = torch.nn.Linear(2, 2), torch.randn(3, 2)
    expected = layer(x)
    add_hook_to_module(layer, ModelHook())
    patch = Patch("layer")
    patch.wrap_method(layer, "forward", lambda original: lambda inputs: original(inputs) * 2)
    assert torch.equal(layer(x), expected * 2)
    remove_hook_from_module(layer)
    add_hook_to_module(layer, ModelHook())
    assert torch.equal(layer(x), expected * 2), "the patch survives the hook being re-installed"
    patch.remove()
    assert torch.equal(layer(x), expected) and hasattr(layer, "_hf_hook")
    remove_hook_from_module(layer)
    assert layer.forward.__func__ is torch.nn.Linear.forward


def test_remove_after_the_accelerate_hook_holding_the_wrapper_was_removed():
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    layer, x = torch.nn.Linear(2, 2), torch.randn(3, 2)
    expected = layer(x)
    add_hook_to_module(layer, ModelHook())
    patch = Patch("layer")
    patch.wrap_method(layer, "forward", lambda original: lambda inputs: original(inputs) * 2)
    remove_hook_from_module(layer)  # accelerate puts the wrapper back as forward
    assert torch.equal(layer(x), expected * 2)
    patch.remove()
    assert "forward" not in vars(layer) and "_old_forward" not in vars(layer)
    assert torch.equal(layer(x), expected)
