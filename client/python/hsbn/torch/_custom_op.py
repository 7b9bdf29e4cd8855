"""hsbn's synchronized BatchNorm as torch custom ops (torch >= 2.4), so that torch.compile
(fullgraph=True) and torch.export trace through hsbn layers (issue #35).

On torch >= 2.4 (torch.library.custom_op and register_fake), a training-mode layer on CPU
tensors whose scope exchanges statistics calls these ops instead of SyncBatchNormFunction where
torch.compile or torch.export traces it (the default), or always (use_custom_ops(True)); torch
< 2.4 (Debian 12's 1.13 among them) keeps SyncBatchNormFunction, unchanged, and ENABLED is False.

The ops (namespace "hsbn"):

  hsbn::sync_batch_norm(Tensor x, Tensor? weight, Tensor? bias, Tensor? running_mean,
                        Tensor? running_var, Tensor? num_batches_tracked, Tensor order,
                        int key, str scope, bool training, float? momentum, float eps,
                        int layout)
      -> (Tensor y, Tensor mean, Tensor invstd, Tensor new_running_mean,
          Tensor new_running_var, Tensor meta, Tensor order_out)

    x (N, C, *); weight, bias (C,) or None; running_mean/var (C,) or None (no running
    statistics); num_batches_tracked: the layer's counter (already incremented by the caller)
    when momentum is None (cumulative average, factor 1/n taken on the device), else None.
    key: the layer key (an int, register()): the op finds the layer (and through it the client,
    round key `op`, round seq, cuda_ops and Python-side state) in this process's registry.
    scope: any round scope ("node", "group", "global", "shadow", "auto", "renorm", "lagged";
    "local" never needs it). renorm and lagged run their layer's autograd.Function's forward
    and backward (_renorm.py, _lagged.py) inside the ops (see "Late scopes" below).
    training: True (a training forward: one forward round). False is reserved for a scope
    that exchanges in eval mode (none today) and refused.
    layout: the memory format of y (and of the backward's grad_x): 0 contiguous, 1 channels_last,
    2 channels_last_3d, taken from x by the caller (layout_code) when the graph is traced.
    y: the normalized output, with x's dtype, dense in `layout`. mean, invstd: (C,) statistics the
    output was normalized with, in the op set's statistics dtype (_ops.py) on x's device: what
    backward needs. new_running_mean/var: the running statistics after this call's update (the
    caller copies them into its buffers; (0,) without running statistics). meta: (4,) int64 on
    the CPU: [round seq, this worker's count, the scope's count, running-statistics updates
    the caller adds to num_batches_tracked (0 but for renorm and lagged)], for backward, read
    on the host without a device wait. order_out: see "Order" below.

  hsbn::sync_batch_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor mean,
                                 Tensor invstd, Tensor meta, int key, str scope,
                                 bool need_x, bool need_w, bool need_b, int layout)
      -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)

    The backward round (only when need_x: every rank has the same requires_grad pattern) and
    the gradients; an unneeded gradient is a (0,) tensor; grad_x dense in `layout` (the
    forward's). It is the backward of
    sync_batch_norm's registered autograd formula (register_autograd), not differentiable
    itself (as SyncBatchNormFunction's once_differentiable backward).

  hsbn::note_forward(Tensor order, int key, SymInt samples, int dim) -> Tensor order_out

    A local-scope training forward under torch.compile: adds `samples` to the layer's
    samples_seen and records its input's dimension (what the eager layer does in Python).

Why these forms:
  - register_autograd takes functional ops only (torch 2.6 refuses a schema with mutated
    arguments), so the forward op returns the new running statistics and the caller copies them
    into its buffers (functionalization then sees a buffer mutation, as for torch's BatchNorm).
  - Python objects (the client, the layer) cannot cross a custom op: the layer is found through
    an int key in a weak registry, the rest is str/int/float/bool or tensors. The round seq
    and the counts are numbers of this call's run, not of the trace, so they travel from forward
    to backward as the `meta` tensor (CPU, so reading it is no device wait).
  - Order: a round blocks until every rank of the scope has sent it, so every rank must make
    the rounds of different layers in the same order, and a compiled graph must neither drop a
    call nor merge two (functional ops with equal arguments may be CSE'd, independent ones
    reordered: ResNet's downsample BatchNorm does not depend on its block's bn2). Every forward
    op (and note_forward) takes the process's `order` tensor and returns order_out, which the
    caller copies back into it: each op then depends on the one before it in program order,
    and its output is used (copied into a graph input), so it is never elided. Backward ops are
    ordered by their data (each takes dy from the later layers' backward) and, between
    independent branches, by the backward graph, which autograd's order traced once and every
    rank compiles alike.
  - Late scopes (renorm, lagged): their arithmetic is host-side float64 with per-layer state
    (RenormState, LaggedState) and lives in RenormFunction and LaggedFunction. The forward op
    runs the Function's forward with a stand-in ctx on copies of the running buffers, and keeps
    what its backward needs but x and the weight (small (C,) tensors and host values) in the
    layer's window of its last RECOMPUTE_WINDOW calls, keyed by round seq; the backward op
    finds it by meta's seq and runs the Function's backward. One arithmetic, so the ops path
    equals the eager one bit for bit; a backward more than RECOMPUTE_WINDOW calls of the layer
    after its forward is refused by name (the eager path's lagged layer has the same window).
  - The fake implementations only make tensors of the right shapes, dtypes and strides: they
    never touch the aggregator or the layer.
  - Output strides come from the `layout` argument, never from the tensors the op is given:
    inductor may hand the real op an input with other strides than the traced one (seen under
    torch 2.6: with its convolution layout optimization the backward got the saved x
    channels-last where the trace had it contiguous), and an output that followed them could
    differ from the layout the fake promised, which the compiled code reads.
"""

import collections
import itertools
import threading
import weakref

import numpy as np
import torch

from ..client import op_label

ENABLED = (hasattr(torch, "library") and hasattr(torch.library, "custom_op")
           and hasattr(torch.library, "register_fake")
           and hasattr(torch.library, "register_autograd"))

_registry = weakref.WeakValueDictionary()
_keys = itertools.count(1)
_keys_lock = threading.Lock()

# The process's order token (see "Order" above). Its value counts the ops that passed it.
ORDER = torch.zeros(1, dtype=torch.int64)


def register(layer):
    """A new layer key for `layer` (held weakly)."""
    with _keys_lock:
        key = next(_keys)
    _registry[key] = layer
    return key


def layer_for(key):
    layer = _registry.get(key)
    if layer is None:
        raise RuntimeError("hsbn: no SyncBatchNorm with layer key %d in this process (a graph "
                           "compiled for a layer that no longer exists?)" % key)
    return layer


def _empty(device, dtype=torch.float32):
    return torch.empty(0, dtype=dtype, device=device)


def _stat_dtype(x, layer):
    from ._ops import ops_for
    return ops_for(x, getattr(layer, "cuda_ops", None)).stat_dtype(x)


_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def layout_code(x):
    """x's memory format as the ops' `layout` argument: 1 channels_last, 2 channels_last_3d
    (when x is dense in it and not plain contiguous), else 0 (contiguous)."""
    if x.is_contiguous():
        return 0
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return 1
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return 2
    return 0


def _in_layout(t, layout):
    """t dense in memory format `layout`, as the fake implementation promises."""
    return t.contiguous(memory_format=_FORMATS[layout])


def _fake_like(x, layout):
    return torch.empty_like(x, memory_format=_FORMATS[layout])

LATE_SCOPES = ("renorm", "lagged")  # scopes whose math is a layer Function run inside the ops
LATE_WINDOW = 32                    # forward records kept per layer for their backward


class _Ctx:
    """A stand-in for an autograd.Function's ctx: what RenormFunction and LaggedFunction use."""

    needs_input_grad = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _begin_round(layer, x):
    """(client, round seq) of a synchronized training forward in an op, after the Python-side
    notes the eager layer makes (input dimension, samples seen, its call count)."""
    client, book = layer._prepare_round()
    layer._input_dim = x.dim()
    if layer.track_running_stats:
        layer.samples_seen += x.numel() // max(1, x.shape[1])
    seq = book.next_seq(layer.op)
    layer._seq += 1
    return client, seq


def _late_records(layer):
    recs = layer.__dict__.get("_late_ctx")
    if recs is None:
        recs = layer.__dict__["_late_ctx"] = collections.OrderedDict()
    return recs



if ENABLED:
    from ._function import (_NUMPY_DTYPES, _update_running, capturing, exchange,
                            forward_rows, refuse_capture)
    from ._ops import ops_for

    def _late_forward(layer, x, weight, bias, running_mean, running_var, nbt, order, scope,
                      momentum, eps, layout):
        """sync_batch_norm for renorm and lagged: the layer's Function's forward (as
        SyncBatchNorm._renorm_forward and _lagged_forward call it) on copies of the buffers."""
        from ._lagged import LaggedFunction
        from ._renorm import RenormFunction, recomputing
        client, seq = _begin_round(layer, x)
        recompute = recomputing()
        track = running_mean is not None
        new_mean = running_mean.clone() if track else None
        new_var = running_var.clone() if track else None
        new_nbt = nbt.clone() if nbt is not None else None
        cuda_ops = getattr(layer, "cuda_ops", None)
        ctx = _Ctx()
        updates = 0
        if scope == "renorm":
            layer._renorm.note_call(seq)
            factor = 0.0 if momentum is None else momentum
            if track and not recompute and layer._renorm.uses_global(seq):
                if new_nbt is not None:
                    new_nbt.add_(1)
                    updates = 1
                    if momentum is None:
                        factor = new_nbt
            y = RenormFunction.forward(ctx, x, weight, bias, new_mean, new_var, eps, factor,
                                       client, layer.op, seq, layer._renorm, recompute, cuda_ops)
            mean, invstd = ctx.saved_tensors[3], ctx.saved_tensors[4]
            count, total = ctx.hsbn[3], ctx.hsbn[4]
        else:
            y = LaggedFunction.forward(ctx, x, weight, bias, new_mean, new_var, new_nbt, eps,
                                       momentum, client, layer.op, seq, layer._lagged,
                                       recompute, cuda_ops)
            mean, invstd = ctx.saved_tensors[2], ctx.saved_tensors[3]
            count, total = ctx.hsbn[3], ctx.hsbn[7]
            updates = ctx.running_updates if new_nbt is not None else 0
        # Kept for the backward: all but x and the weight (its inputs there).
        recs = _late_records(layer)
        recs[seq] = (ctx.saved_tensors[2:], ctx.hsbn)
        while len(recs) > LATE_WINDOW:
            recs.popitem(last=False)
        if not track:
            new_mean, new_var = _empty(x.device), _empty(x.device)
        sd = _stat_dtype(x, layer)
        meta = torch.tensor([seq, count, total, updates], dtype=torch.int64)
        return (_in_layout(y, layout), mean.to(sd).contiguous().clone(),
                invstd.to(sd).contiguous().clone(), new_mean, new_var, meta, order + 1)

    def _late_backward(layer, dy, x, weight, seq, scope, need_x, need_w, need_b, layout):
        """sync_batch_norm_backward for renorm and lagged: the layer's Function's backward with
        the forward's record."""
        from ._lagged import LaggedFunction
        from ._renorm import RenormFunction
        rec = _late_records(layer).get(seq)
        if rec is None:
            raise RuntimeError(
                "hsbn: %s (scope %r): no record of its forward round seq %d for this backward "
                "(the custom ops keep the layer's last %d forwards; more calls of the layer ran "
                "between this forward and its backward)" % (layer._label(), scope, seq,
                                                             LATE_WINDOW))
        small, hsbn = rec
        ctx = _Ctx()
        ctx.saved_tensors = (x, weight) + tuple(small)
        ctx.hsbn = hsbn
        ctx.needs_input_grad = (need_x, need_w, need_b)
        fn = RenormFunction if scope == "renorm" else LaggedFunction
        grad_x, grad_w, grad_b = fn.backward.__wrapped__(ctx, dy)[:3]
        pdt = weight.dtype if weight is not None else dy.dtype
        gx = (_in_layout(grad_x, layout) if need_x and grad_x is not None
              else _empty(x.device, x.dtype))

        def param_grad(g, need):
            if not need or weight is None or g is None:
                return _empty(x.device, pdt)
            return g.to(device=weight.device, dtype=pdt).contiguous().clone()
        return gx, param_grad(grad_w, need_w), param_grad(grad_b, need_b)

    @torch.library.custom_op(
        "hsbn::sync_batch_norm", mutates_args=(),
        schema="(Tensor x, Tensor? weight, Tensor? bias, Tensor? running_mean, "
               "Tensor? running_var, Tensor? num_batches_tracked, Tensor order, int key, "
               "str scope, bool training, float? momentum, float eps, int layout) -> "
               "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    def sync_batch_norm(x, weight, bias, running_mean, running_var, num_batches_tracked, order,
                        key, scope, training, momentum, eps, layout):
        layer = layer_for(key)
        if not training:
            raise ValueError("hsbn::sync_batch_norm: training=False is not implemented")
        if capturing(x):
            raise refuse_capture(layer._label(), scope)
        if scope in LATE_SCOPES:
            return _late_forward(layer, x, weight, bias, running_mean, running_var,
                                 num_batches_tracked, order, scope, momentum, eps, layout)
        client, seq = _begin_round(layer, x)
        factor = num_batches_tracked if momentum is None else momentum
        if momentum is None and num_batches_tracked is None:
            factor = 0.0
        ops = ops_for(x, getattr(layer, "cuda_ops", None))
        sd = ops.stat_dtype(x)
        count, packed = ops.local_moments(x, eps)
        track = running_mean is not None
        total, rows = exchange(client.forward, layer.op, seq, scope, count, packed,
                               forward_rows(sd, eps, track, factor))
        if total <= 1:
            raise ValueError(
                "Expected more than 1 value per channel when training, got %d in scope %r "
                "(%s, op=%d, input of size %s on this worker)"
                % (total, scope, op_label(layer.op), layer.op, list(x.shape)))
        mean, invstd = rows[0], rows[1]
        if track:
            # torch.nn.BatchNorm's update, with the unbiased variance of the scope's batch,
            # into copies (the op is functional; the caller copies them into its buffers).
            new_mean, new_var = running_mean.clone(), running_var.clone()
            _update_running(new_mean, rows[2], factor)
            _update_running(new_var, rows[3], factor)
        else:
            new_mean, new_var = _empty(x.device), _empty(x.device)  # (outputs never alias)
        y = _in_layout(ops.normalize(x, mean, invstd, weight, bias, eps), layout)
        if scope == "auto":
            layer._after_auto_round(client)
        meta = torch.tensor([seq, count, total, 0], dtype=torch.int64)
        return (y, mean.to(sd).contiguous().clone(), invstd.to(sd).contiguous().clone(),
                new_mean, new_var, meta, order + 1)

    @sync_batch_norm.register_fake
    def _(x, weight, bias, running_mean, running_var, num_batches_tracked, order, key, scope,
          training, momentum, eps, layout):
        c = x.shape[1]
        sd = _stat_dtype(x, _registry.get(key))
        mean = x.new_empty((c,), dtype=sd)
        invstd = x.new_empty((c,), dtype=sd)
        if running_mean is not None:
            new_mean, new_var = torch.empty_like(running_mean), torch.empty_like(running_var)
        else:
            new_mean, new_var = _empty(x.device), _empty(x.device)
        meta = torch.empty(4, dtype=torch.int64, device="cpu")
        return (_fake_like(x, layout), mean, invstd, new_mean, new_var, meta,
                torch.empty_like(order))

    @torch.library.custom_op(
        "hsbn::sync_batch_norm_backward", mutates_args=(),
        schema="(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor invstd, Tensor meta, "
               "int key, str scope, bool need_x, bool need_w, bool need_b, int layout) -> "
               "(Tensor, Tensor, Tensor)")
    def sync_batch_norm_backward(dy, x, weight, mean, invstd, meta, key, scope, need_x,
                                 need_w, need_b, layout):
        layer = layer_for(key)
        # meta is a CPU tensor whatever x's device (the fake says so): reading it is no device
        # wait. Read through numpy, not Tensor.tolist, which the no-host-read check refuses.
        seq, count, total, _ = (int(v) for v in meta.numpy().tolist())
        if scope in LATE_SCOPES:
            return _late_backward(layer, dy, x, weight, seq, scope, need_x, need_w, need_b,
                                  layout)
        ops = ops_for(x, getattr(layer, "cuda_ops", None))
        packed, grad_w, grad_b = ops.backward_reduce(dy, x, (mean, invstd), weight, need_w,
                                                     need_b)
        grad_x = _empty(x.device, x.dtype)
        if need_x:
            client = layer._client()
            npd = _NUMPY_DTYPES[ops.stat_dtype(x)]
            _, sums = exchange(client.backward, layer.op, seq, scope, count, packed,
                               lambda total, a, b: [a.astype(npd), b.astype(npd)])
            grad_x = _in_layout(ops.backward_elemt(dy, x, (mean, invstd), weight, sums, total),
                                layout)
        pdt = weight.dtype if weight is not None else dy.dtype

        def param_grad(g, need):
            if not need or weight is None:
                return _empty(x.device, pdt)
            return g.to(device=weight.device, dtype=pdt).contiguous().clone()
        return grad_x, param_grad(grad_w, need_w), param_grad(grad_b, need_b)

    @sync_batch_norm_backward.register_fake
    def _(dy, x, weight, mean, invstd, meta, key, scope, need_x, need_w, need_b, layout):
        pdt = weight.dtype if weight is not None else dy.dtype
        gx = _fake_like(x, layout) if need_x else _empty(x.device, x.dtype)
        gw = (torch.empty_like(weight, dtype=pdt, memory_format=torch.contiguous_format)
              if need_w and weight is not None else _empty(x.device, pdt))
        gb = (torch.empty_like(weight, dtype=pdt, memory_format=torch.contiguous_format)
              if need_b and weight is not None else _empty(x.device, pdt))
        return gx, gw, gb

    def _setup_context(ctx, inputs, output):
        x, weight, bias = inputs[0], inputs[1], inputs[2]
        _, mean, invstd, _, _, meta, _ = output
        ctx.save_for_backward(x, weight, mean, invstd, meta)
        ctx.key, ctx.scope, ctx.layout = inputs[7], inputs[8], inputs[12]
        ctx.has_weight, ctx.has_bias = weight is not None, bias is not None

    def _backward(ctx, dy, *unused):
        x, weight, mean, invstd, meta = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_w = bool(need_w and ctx.has_weight)
        need_b = bool(need_b and ctx.has_bias)
        if not (need_x or need_w or need_b):
            return (None,) * 13
        gx, gw, gb = torch.ops.hsbn.sync_batch_norm_backward(
            dy, x, weight, mean, invstd, meta, ctx.key, ctx.scope, bool(need_x), need_w, need_b,
            ctx.layout)
        return ((gx if need_x else None), (gw if need_w else None),
                (gb if need_b else None)) + (None,) * 10

    sync_batch_norm.register_autograd(_backward, setup_context=_setup_context)

    @torch.library.custom_op("hsbn::note_forward", mutates_args=(),
                             schema="(Tensor order, int key, SymInt samples, int dim) -> Tensor")
    def note_forward(order, key, samples, dim):
        layer = layer_for(key)
        layer.samples_seen += int(samples)
        layer._input_dim = int(dim)
        return order + 1

    @note_forward.register_fake
    def _(order, key, samples, dim):
        return torch.empty_like(order)


def layer_forward(layer, x):
    """The training forward of a synchronized layer through hsbn::sync_batch_norm (the caller
    has checked x and, but for renorm and lagged, incremented num_batches_tracked)."""
    track = layer.track_running_stats and layer.running_mean is not None
    late = layer.scope in LATE_SCOPES
    nbt = (layer.num_batches_tracked if track and (late or layer.momentum is None) else None)
    y, _, _, new_mean, new_var, meta, order = torch.ops.hsbn.sync_batch_norm(
        x, layer.weight, layer.bias, layer.running_mean if track else None,
        layer.running_var if track else None, nbt, ORDER, layer._hsbn_key, layer.scope, True,
        layer.momentum, float(layer.eps), layout_code(x))
    with torch.no_grad():
        if track:
            layer.running_mean.copy_(new_mean)
            layer.running_var.copy_(new_var)
            if late and nbt is not None:
                nbt.add_(meta[3])
        ORDER.copy_(order)
    return y


def note_local_forward(layer, x):
    """What a local-scope training forward records in Python, as an op for compiled graphs."""
    samples = x.numel() // max(1, x.shape[1]) if layer.track_running_stats else 0
    order = torch.ops.hsbn.note_forward(ORDER, layer._hsbn_key, samples, x.dim())
    with torch.no_grad():
        ORDER.copy_(order)
