"""convert_sync_batchnorm: what it replaces, what it keeps, and how layers get ops and scopes.
These run in the test process; nothing is exchanged."""

import pytest
import torch

import hsbn
import hsbn.torch


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.SyncBatchNorm(4, momentum=None)),
        torch.nn.Flatten(),
        torch.nn.BatchNorm1d(16, affine=False),
        torch.nn.Sequential(torch.nn.Identity(), torch.nn.BatchNorm3d(2, eps=1e-3,
                                                                     track_running_stats=False)),
    )


def bn_layers(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, hsbn.torch.SyncBatchNorm)]


def test_every_batchnorm_and_torch_syncbatchnorm_is_replaced_keeping_state():
    model = make_model()
    with torch.no_grad():
        model[1].running_mean.fill_(0.25)
        model[1].num_batches_tracked.fill_(7)
    model[1].weight.requires_grad_(False)
    model[2][1].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model[1].weight
    converted = hsbn.torch.convert_sync_batchnorm(model, scope="node")
    assert converted is model
    names = [n for n, _ in bn_layers(converted)]
    assert names == ["1", "2.1", "4", "5.1"]
    assert not any(type(m) in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d,
                               torch.nn.SyncBatchNorm) for m in converted.modules())
    after = converted.state_dict()
    assert sorted(after) == sorted(before)
    for k in before:
        assert torch.equal(after[k], before[k]), k
    assert converted[1].weight is weight and not converted[1].weight.requires_grad
    assert converted[2][1].momentum is None and not converted[2][1].training
    assert converted[4].weight is None and converted[4].running_mean is not None
    assert converted[5][1].eps == 1e-3 and converted[5][1].running_mean is None
    assert all(m.scope == "node" for _, m in bn_layers(converted))


def test_ops_are_name_hashes_independent_of_what_the_process_built_before():
    converted = hsbn.torch.convert_sync_batchnorm(make_model())
    ops = {n: m.op for n, m in bn_layers(converted)}
    assert ops == {n: hsbn.torch.op_for_name("Sequential." + n) for n in ops}
    assert all(op >= 1 << 31 for op in ops.values()) and len(set(ops.values())) == 4
    # Layers constructed in between (an EMA copy's, a teacher's) change nothing: a second
    # model converted under the same name has the same keys.
    hsbn.torch.SyncBatchNorm(4)
    again = hsbn.torch.convert_sync_batchnorm(make_model())
    assert {n: m.op for n, m in bn_layers(again)} == ops


def test_converting_twice_leaves_hsbn_layers_alone():
    once = hsbn.torch.convert_sync_batchnorm(make_model(), scope="global")
    ops = [(n, m.op, m.scope) for n, m in bn_layers(once)]
    twice = hsbn.torch.convert_sync_batchnorm(once, scope="local")
    assert [(n, m.op, m.scope) for n, m in bn_layers(twice)] == ops


def test_a_batchnorm_module_itself_is_converted_and_returned():
    bn = torch.nn.BatchNorm2d(5)
    out = hsbn.torch.convert_sync_batchnorm(bn, scope="shadow")
    assert isinstance(out, hsbn.torch.SyncBatchNorm) and out.scope == "shadow"
    assert out.weight is bn.weight


def test_layer_scopes_mapping_by_name_and_pattern():
    converted = hsbn.torch.convert_sync_batchnorm(
        make_model(), scope="node", layer_scopes={"1": "global", "5.*": "local"})
    scopes = {n: m.scope for n, m in bn_layers(converted)}
    assert scopes == {"1": "global", "2.1": "node", "4": "node", "5.1": "local"}


def test_layer_scopes_callable_syncs_only_early_layers_globally():
    def early_global(name, module):
        return "global" if name.startswith(("1", "2.")) else None
    converted = hsbn.torch.convert_sync_batchnorm(make_model(), scope="node",
                                                  layer_scopes=early_global)
    scopes = {n: m.scope for n, m in bn_layers(converted)}
    assert scopes == {"1": "global", "2.1": "global", "4": "node", "5.1": "node"}


def test_layer_scopes_naming_no_layer_is_an_error():
    with pytest.raises(hsbn.ConfigurationError, match="'layer9'.*the layers are: 1, 2.1, 4, 5.1"):
        hsbn.torch.convert_sync_batchnorm(make_model(), layer_scopes={"layer9": "global"})


def test_an_unknown_scope_is_an_error():
    with pytest.raises(hsbn.ConfigurationError, match="scope must be one of"):
        hsbn.torch.convert_sync_batchnorm(make_model(), scope="cluster")
    with pytest.raises(hsbn.ConfigurationError, match="for layer '4'"):
        hsbn.torch.convert_sync_batchnorm(make_model(), layer_scopes={"4": "rack"})
    with pytest.raises(hsbn.ConfigurationError):
        hsbn.torch.SyncBatchNorm(4, scope="everything")


def test_local_scope_and_eval_mode_never_need_a_client():
    torch.manual_seed(1)
    ref = torch.nn.BatchNorm2d(3)
    layer = hsbn.torch.SyncBatchNorm(3, scope="local")
    x = torch.randn(4, 3, 2, 2)
    assert torch.allclose(layer(x), ref(x), rtol=0, atol=1e-6)
    assert torch.allclose(layer.running_var, ref.running_var, rtol=0, atol=1e-7)
    layer = hsbn.torch.SyncBatchNorm(3, scope="global").eval()  # no sidecar in this process
    assert torch.allclose(layer(x), torch.nn.BatchNorm2d(3).eval()(x), rtol=0, atol=1e-6)
