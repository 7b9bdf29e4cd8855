"""hsbn.torch against torch's own API: the constructor, convert and revert, FX, copies, and how
layers are keyed. In the test process; the tests that make rounds use a one-worker job on a
real sidecar, over both transports of the node's rounds ([shm], [grpc]: transports.py)."""

import copy
import inspect
import pickle

import pytest
import torch

import hsbn
import hsbn.cluster
import hsbn.torch
import transports


def make_model(torch_sync=True):
    torch.manual_seed(0)
    # torch.nn.SyncBatchNorm runs on CUDA tensors only: the tests that run a model on the CPU
    # take a BatchNorm2d in its place.
    inner = torch.nn.SyncBatchNorm if torch_sync else torch.nn.BatchNorm2d
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), inner(4, momentum=None)),
        torch.nn.Flatten(),
        torch.nn.BatchNorm1d(16, affine=False),
        torch.nn.Unflatten(1, (2, 2, 2, 2)),
        torch.nn.BatchNorm3d(2, eps=1e-3, track_running_stats=False),
    )


def hsbn_layers(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, hsbn.torch.SyncBatchNorm)]


def test_the_constructor_takes_torchs_arguments_in_torchs_order():
    torch_params = list(inspect.signature(torch.nn.SyncBatchNorm.__init__).parameters.values())
    ours = list(inspect.signature(hsbn.torch.SyncBatchNorm.__init__).parameters.values())
    assert [(p.name, p.default) for p in ours[:len(torch_params)]] == \
        [(p.name, p.default) for p in torch_params]
    extra = ours[len(torch_params):]
    # torch >= 2.14 has bias=True (keyword-only) after dtype, and so has hsbn on every torch.
    if extra and extra[0].name == "bias":
        assert extra[0].default is True and extra[0].kind == inspect.Parameter.KEYWORD_ONLY
        extra = extra[1:]
    assert [p.name for p in extra] == ["scope", "client", "name", "op", "group_nodes",
                                      "auto_warmup", "auto_max_mean_shift",
                                      "auto_max_log_var_ratio", "auto_recheck_every",
                                      "renorm_lag", "renorm_momentum", "renorm_warmup",
                                      "renorm_r_max", "renorm_d_max", "renorm_ramp",
                                      "lagged_damping", "lagged_warmup", "lagged_trip",
                                      "lagged_trip_calls", "lagged_trip_rel", "lagged_ema"]
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in extra)
    bn = hsbn.torch.SyncBatchNorm(5, 1e-3, 0.2, False, False, None, "cpu", torch.float64)
    assert (bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats) == \
        (5, 1e-3, 0.2, False, False)
    assert bn.weight is None and bn.running_mean is None and bn.scope == "global"
    assert hsbn.torch.SyncBatchNorm(2, dtype=torch.float64).weight.dtype == torch.float64


def test_a_process_group_is_refused_with_the_scope_to_use_and_scope_is_keyword_only():
    with pytest.raises(hsbn.ConfigurationError, match="scope='node'.*scope='global'"):
        hsbn.torch.SyncBatchNorm(4, process_group=object())
    with pytest.raises(hsbn.ConfigurationError, match="process group"):
        hsbn.torch.convert_sync_batchnorm(make_model(), object())
    with pytest.raises(TypeError, match="scope is a keyword argument"):
        hsbn.torch.SyncBatchNorm(4, 1e-5, 0.1, True, True, "node")
    with pytest.raises(TypeError):
        hsbn.torch.SyncBatchNorm(4, 1e-5, 0.1, True, True, None, None, None, "node")
    # torch's spelling works: the classmethod, process_group=None.
    converted = hsbn.torch.SyncBatchNorm.convert_sync_batchnorm(make_model(), None,
                                                                scope="node")
    assert all(m.scope == "node" for _, m in hsbn_layers(converted))


def test_convert_then_revert_gives_back_torch_syncbatchnorm_with_its_state():
    original = make_model()
    with torch.no_grad():
        original[2][1].running_var.uniform_()
    state = copy.deepcopy(original.state_dict())
    reverted = hsbn.torch.revert_sync_batchnorm(hsbn.torch.convert_sync_batchnorm(original))
    assert type(reverted[2][1]) is torch.nn.SyncBatchNorm and reverted[2][1].momentum is None
    assert all(torch.equal(v, state[k]) for k, v in reverted.state_dict().items())


def test_convert_then_revert_gives_back_the_original_modules_and_state():
    original = make_model(torch_sync=False)
    original[1].weight.requires_grad_(False)
    original[2][1].eval()
    with torch.no_grad():
        original[1].running_mean.uniform_()
        original[4].num_batches_tracked.fill_(3)
    reference = copy.deepcopy(original)
    converted = hsbn.torch.convert_sync_batchnorm(original, scope="local")
    # Train the converted model a little (local scope: plain BatchNorm arithmetic) and the
    # reference the same way: the state must come back with the training in it.
    for model in (converted, reference):
        model.train()
        model[2][1].eval()
        torch.manual_seed(1)
        for _ in range(2):
            model(torch.randn(6, 3, 4, 4)).square().sum().backward()
    reverted = hsbn.torch.revert_sync_batchnorm(converted)
    assert [type(m) for m in reverted.modules()] == [type(m) for m in reference.modules()]
    assert not any(isinstance(m, hsbn.torch.SyncBatchNorm) for m in reverted.modules())
    ref_state, state = reference.state_dict(), reverted.state_dict()
    assert list(state) == list(ref_state)
    for key in ref_state:
        assert torch.allclose(state[key].double(), ref_state[key].double(), rtol=0,
                              atol=1e-12), key
    for (name, m), (_, r) in zip(reverted.named_modules(), reference.named_modules()):
        assert m.training == r.training, name
        if isinstance(r, torch.nn.modules.batchnorm._BatchNorm):
            assert (m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats) == \
                (r.num_features, r.eps, r.momentum, r.affine, r.track_running_stats), name
    assert [p.requires_grad for p in reverted.parameters()] == \
        [p.requires_grad for p in reference.parameters()]
    for model in (reverted, reference):
        model.eval()
    x = torch.randn(3, 3, 4, 4)
    assert torch.allclose(reverted(x), reference(x), rtol=0, atol=1e-6)


def test_revert_of_directly_constructed_layers_follows_their_last_input():
    layers = torch.nn.ModuleList([hsbn.torch.SyncBatchNorm(3, scope="local") for _ in range(4)])
    layers[0](torch.randn(4, 3))
    layers[1](torch.randn(4, 3, 5))
    layers[2](torch.randn(4, 3, 2, 2))
    reverted = hsbn.torch.revert_sync_batchnorm(layers)
    assert [type(m).__name__ for m in reverted] == ["BatchNorm1d", "BatchNorm1d", "BatchNorm2d",
                                                    "_BatchNormXd"]
    assert reverted[3](torch.randn(4, 3, 2, 2, 2)).shape == (4, 3, 2, 2, 2)


def test_the_layer_is_an_fx_leaf():
    model = hsbn.torch.convert_sync_batchnorm(make_model(), scope="global")
    traced = torch.fx.symbolic_trace(model)
    calls = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert calls == ["0", "1", "2.0", "2.1", "3", "4", "5", "6"]
    assert isinstance(traced.get_submodule("2.1"), hsbn.torch.SyncBatchNorm)
    model.eval()
    traced.eval()
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(traced(x), model(x))


def test_layers_are_keyed_by_model_and_qualified_name():
    a = hsbn.torch.convert_sync_batchnorm(make_model())
    hsbn.torch.SyncBatchNorm(4)  # constructed in between: changes nothing
    b = hsbn.torch.convert_sync_batchnorm(make_model())
    c = hsbn.torch.convert_sync_batchnorm(make_model(), name="teacher")
    keys = [(n, m.model_name, m.layer_name, m.op) for n, m in hsbn_layers(a)]
    assert keys == [(n, "Sequential", n, hsbn.torch.op_for_name("Sequential." + n))
                    for n in ("1", "2.1", "4", "6")]
    assert [m.op for _, m in hsbn_layers(b)] == [k[3] for k in keys]
    assert [m.op for _, m in hsbn_layers(c)] == [hsbn.torch.op_for_name("teacher." + n)
                                                for n in ("1", "2.1", "4", "6")]
    assert "name='2.1'" in repr(c)


def test_direct_layers_are_numbered_unless_named_and_conversion_names_them():
    first, second = hsbn.torch.SyncBatchNorm(3), hsbn.torch.SyncBatchNorm(3)
    assert second.op == first.op + 1 and second.op < 1 << 30
    named = hsbn.torch.SyncBatchNorm(3, name="neck.bn")
    assert named.op == hsbn.torch.op_for_name("neck.bn") and named.op >= 1 << 31
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), hsbn.torch.SyncBatchNorm(3, scope="node"),
                                named)
    hsbn.torch.convert_sync_batchnorm(model, scope="global", name="Net")
    assert model[1].op == hsbn.torch.op_for_name("Net.1") and model[1].scope == "node"
    assert model[2].op == hsbn.torch.op_for_name("neck.bn")  # an explicit name is kept
    # Converting again under another name re-keys what conversion keyed.
    hsbn.torch.convert_sync_batchnorm(model, name="Other")
    assert model[1].op == hsbn.torch.op_for_name("Other.1")


def test_pickle_and_deepcopy_keep_the_keys():
    model = hsbn.torch.convert_sync_batchnorm(make_model(), name="Net")
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert [(n, m.op, m.layer_name, m.scope) for n, m in hsbn_layers(clone)] == \
            [(n, m.op, m.layer_name, m.scope) for n, m in hsbn_layers(model)]
        assert hsbn.torch.revert_sync_batchnorm(clone)[1].__class__ is torch.nn.BatchNorm2d


@pytest.fixture(scope="module")
def client(transport):
    with pytest.MonkeyPatch.context() as mp:
        # The library reads HSBN_TRANSPORT when the client joins (and re-joins).
        mp.setenv("HSBN_TRANSPORT", transports.ENV[transport])
        with hsbn.cluster.LocalCluster(nodes=1, workers_per_node=1, root=False) as one:
            with hsbn.Client.from_env(one.worker_env(0)) as c:
                yield c
                assert c.stats().transport == transports.EXPECTED[transport]


def test_a_model_converted_again_under_the_same_name_goes_on_with_new_round_keys(client):
    # A trainer that builds and converts a fresh model per run (as the comparison job does) in
    # one process and one job: the second model's rounds must not reuse the first's keys,
    # which the aggregator would refuse as a different payload for a finished round.
    def run(seed):
        torch.manual_seed(seed)
        model = hsbn.torch.convert_sync_batchnorm(
            torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4)), client=client)
        for _ in range(2):
            model(torch.randn(8, 5)).square().sum().backward()
        return model[1].running_mean.clone()
    first, second = run(0), run(1)
    assert not torch.equal(first, second)
    assert client.stats().total.failed == 0


def test_a_layer_check_passes_on_one_worker_and_is_made_once(client):
    client.reset_stats()
    model = hsbn.torch.convert_sync_batchnorm(make_model(), client=client, name="once")
    model[2][1].train()
    for _ in range(3):
        model(torch.randn(4, 3, 4, 4))
    s = client.stats()
    # 4 layers x 3 forwards, plus one backward-phase round for the check.
    assert s.get("global", "forward").completed == 12
    assert s.get("global", "backward").completed == 1


def test_custom_ops_are_the_default_where_torch_has_them():
    # The ops path (torch >= 2.4) is chosen per process at its first layer: by default where
    # torch has custom ops, the autograd.Function (opaque to dynamo) on older torch and with
    # HSBN_TORCH_CUSTOM_OPS=0; hsbn.torch.use_custom_ops switches it (issue #35).
    import hsbn.torch
    from hsbn.errors import ConfigurationError
    from hsbn.torch import _custom_op
    from hsbn import env as _env
    value = _env.get("HSBN_TORCH_CUSTOM_OPS") if _env.is_set("HSBN_TORCH_CUSTOM_OPS") else ""
    expected = (value == "1") if value else ("compiled" if _custom_op.ENABLED else False)
    before = hsbn.torch.custom_ops_in_use()
    assert before == expected and type(before) is type(expected)
    SBN = hsbn.torch.SyncBatchNorm
    assert SBN.forward is {True: SBN._forward_selecting, "compiled": SBN._forward_traced,
                           False: SBN._forward_function}[expected]
    with pytest.raises(ConfigurationError, match="True, False or"):
        hsbn.torch.use_custom_ops("always")
    if not _custom_op.ENABLED:
        for flag in (True, "compiled"):
            with pytest.raises(ConfigurationError, match="torch.library.custom_op"):
                hsbn.torch.use_custom_ops(flag)
        assert hsbn.torch.custom_ops_in_use() is False
        return
    try:
        for flag in (True, False, "compiled"):
            hsbn.torch.use_custom_ops(flag)
            assert hsbn.torch.custom_ops_in_use() == flag
    finally:
        hsbn.torch.use_custom_ops(before)
    assert hsbn.torch.custom_ops_in_use() == before


def test_bias_false_is_refused_by_name_and_true_is_torchs_default():
    # torch 2.14 added bias=False (a weight without a bias) to BatchNorm; hsbn's layers take
    # the keyword where torch does, and refuse False with affine by name instead of adding a
    # bias the model did not ask for.
    from hsbn.errors import ConfigurationError
    layer = hsbn.torch.SyncBatchNorm(4, bias=True, scope="local")
    assert layer.bias is not None and layer.weight is not None
    assert hsbn.torch.SyncBatchNorm(4, affine=False, bias=False, scope="local").bias is None
    with pytest.raises(ConfigurationError, match="bias=False"):
        hsbn.torch.SyncBatchNorm(4, bias=False, scope="local")
    with pytest.raises(ConfigurationError, match="True or False"):
        hsbn.torch.SyncBatchNorm(4, bias="no", scope="local")
    # A torch BatchNorm with a weight and no bias (what torch 2.14's bias=False makes, built
    # here by hand so that every torch has one) is refused by convert_sync_batchnorm, naming it.
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
    model[1].bias = None
    with pytest.raises(ConfigurationError, match="'1' has a weight but no bias"):
        hsbn.torch.convert_sync_batchnorm(model, scope="local")
