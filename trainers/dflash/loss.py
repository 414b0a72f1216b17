"""Provides the DFlash training objective: anchors, block inputs, the attention mask, labels, decay weights, chunked lm_head + CE.

Follows SpecForge's ``OnlineDFlashModel`` (see shared/research/trainers.md, section A):

* ``sample_anchors`` draws ``num_anchors`` anchor positions per sample, uniformly
  (without replacement) among positions ``t`` where ``loss_mask[t]`` and
  ``loss_mask[t+1]`` are both set, redrawn every step, sorted ascending. A sample
  with fewer valid positions than ``num_anchors`` gets all of them, and the
  remaining slots are marked invalid in ``keep`` (they carry zero loss weight).
* ``block_inputs``: block ``i`` is ``[input_ids[a_i], MASK, ..., MASK]`` (B tokens)
  at positions ``a_i + k``.
* ``build_attention_mask``: one dense bool mask ``[b, 1, N*B, S + N*B]`` (True =
  may attend). A block token sees the context positions strictly before its
  anchor plus its whole own block (non-causal), nothing else.
* ``labels_and_weights``: slot ``k`` predicts ``input_ids[a + k]`` (no shift);
  slot 0 is the given anchor and carries no loss. Weight ``loss_mask[a+k] *
  exp(-(k-1)/gamma)``; positions past the sequence end get weight 0.
* ``decay_gamma``: 7 for B=16, 5 for B=10, 4 for B=8 (the published values);
  any other block size needs an explicit gamma (``GammaError``: no invented default). Both live in
  trainers/dflash/gamma.py (no torch, for the argument checks).
* Normalisation (SpecForge's ``TrainerCore``): each micro-batch backpropagates its
  weighted CE *sum*; once per optimizer step ``finish_global_mean`` all-reduces the
  sums and the weight totals over the drafter ranks and scales the gradients so
  that they are those of ``sum(w*CE) / sum(w)`` over every rank and micro-batch
  (not a mean of per-micro-batch means).
* ``chunked_linear_cross_entropy``: ``sum(w * CE(h @ W.T, y))`` without ever
  materialising the full ``[M, V]`` logits. Two modes share one autograd Function:

  - ``"fused"`` (default): while the forward walks over row chunks it also
    computes the chunk's gradient w.r.t. the hidden states (softmax - onehot,
    times w, times W) and keeps only that ``[M, H]`` result; backward just scales
    it by the incoming scalar gradient. Peak extra memory is one chunk's logits
    and their gradient (plus ``[M, H]``); compute is the plain version's matmul
    budget (logits, grad_h, and grad_W only when W requires grad). On CUDA the
    softmax/CE/gradient of a chunk is one ``torch.compile``d kernel
    (``_softmax_ce_grad``: two reductions and one pointwise pass over bf16
    logits) instead of ~8 eager passes over fp32 copies.
  - ``"recompute"``: the forward saves nothing but its inputs; backward
    recomputes each chunk's logits (checkpointing). One more matmul than plain.

  The loss value and gradients match plain ``F.cross_entropy`` (tested in float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpudeck.trainers.dflash.gamma import decay_gamma


def valid_anchor_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions t with loss_mask[t] and loss_mask[t+1] set: [b, S] bool (last position never valid)."""
    lm = loss_mask.bool()
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return valid


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw sorted anchor positions per sample, uniformly without replacement among valid positions.

    Returns ``(anchors [b, N] long, keep [b, N] bool)`` with ``N = min(num_anchors, max valid count)``
    (at least 1). Invalid slots (a sample with fewer valid positions) hold anchor 0 and keep False.
    The random draw uses ``generator`` on the CPU, so it is reproducible and checkpointable.
    """
    valid = valid_anchor_mask(loss_mask).cpu()
    bsz, seq_len = valid.shape
    counts = valid.sum(dim=1)
    n = max(1, min(int(num_anchors), int(counts.max().item()) if bsz else 0))
    rand = torch.rand((bsz, seq_len), generator=generator)
    # invalid positions sort last
    rand = torch.where(valid, rand, torch.full_like(rand, 2.0))
    order = rand.argsort(dim=1)[:, :n]
    keep = torch.arange(n).unsqueeze(0) < counts.clamp(max=n).unsqueeze(1)
    anchors = torch.where(keep, order, torch.zeros_like(order))
    # sort the kept anchors ascending; invalid ones (pushed to the end) stay at 0
    big = torch.where(keep, anchors, torch.full_like(anchors, seq_len + 1))
    big, _ = big.sort(dim=1)
    anchors = torch.where(keep, big, torch.zeros_like(big))
    return anchors.to(loss_mask.device), keep.to(loss_mask.device)


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block token ids ``[b, N*B]`` (anchor token then MASKs) and their positions ``a + k``."""
    bsz, n = anchors.shape
    ids = torch.full((bsz, n, block_size), int(mask_token_id), dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    offs = torch.arange(block_size, device=anchors.device)
    pos = anchors.unsqueeze(-1) + offs
    return ids.reshape(bsz, n * block_size), pos.reshape(bsz, n * block_size)


def build_attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int, sliding_window: int | None = None) -> torch.Tensor:
    """Dense bool mask ``[b, 1, N*B, S + N*B]``: context strictly before the anchor + own block.

    With ``sliding_window`` W (a sliding_attention layer; SpecForge's ``create_dflash_sdpa_mask``):
    block slot k (anchor a) sees the context positions ``a+k-(W-1) <= j < a`` and the slots
    ``0..k`` of its own block (the slot itself takes one place of the window).
    """
    bsz, n = anchors.shape
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, NB]
    kv = torch.arange(seq_len, device=dev).view(1, 1, seq_len)
    ctx = kv < q_anchor.unsqueeze(-1)  # [b, NB, S]
    q_idx = torch.arange(n * block_size, device=dev)
    blk_q, off_q = q_idx // block_size, q_idx % block_size
    own = blk_q.view(-1, 1) == blk_q.view(1, -1)  # [NB, NB]
    if sliding_window is not None:
        lower = q_anchor + off_q.view(1, -1) - (int(sliding_window) - 1)  # [b, NB]
        ctx = ctx & (kv >= lower.unsqueeze(-1))
        own = own & (off_q.view(1, -1) <= off_q.view(-1, 1))
    own = own.unsqueeze(0).expand(bsz, -1, -1)  # [b, NB, NB]
    return torch.cat([ctx, own], dim=-1).unsqueeze(1)


def visible_keys(anchors: torch.Tensor, block_size: int, sliding_window: int | None = None) -> float:
    """Keys each block query attends to, summed over all queries (what the attention FLOPs need)."""
    k = torch.arange(block_size, device=anchors.device, dtype=torch.float64)
    a = anchors.to(torch.float64).unsqueeze(-1)  # [b, N, 1]
    if sliding_window is None:
        return float((a + block_size).expand(-1, -1, block_size).sum().item())
    ctx = torch.minimum(a, (int(sliding_window) - 1 - k).clamp(min=0))
    return float((ctx + k + 1).sum().item())


def labels_and_weights(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    gamma: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``[b, N, B]`` (slot k -> input_ids[a+k]) and float weights ``[b, N, B]`` (slot 0 and padding 0)."""
    gamma = decay_gamma(block_size, gamma)
    bsz, seq_len = input_ids.shape
    offs = torch.arange(block_size, device=anchors.device)
    pos = anchors.unsqueeze(-1) + offs  # [b, N, B]
    inside = pos < seq_len
    pos_c = pos.clamp(max=seq_len - 1)
    labels = torch.gather(input_ids, 1, pos_c.view(bsz, -1)).view_as(pos)
    lm = torch.gather(loss_mask.float(), 1, pos_c.view(bsz, -1)).view_as(pos)
    decay = torch.exp(-(offs.float() - 1.0) / float(gamma))
    decay[0] = 0.0
    w = lm * inside.float() * keep.unsqueeze(-1).float() * decay.to(lm.device)
    return labels, w


# --------------------------------------------------------------------------- chunked lm_head + CE


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax/accumulation dtype: float64 stays float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _softmax_ce_grad(logits, y, w):
    """Weighted CE sum of one chunk and its gradient w.r.t. the logits, ``(softmax - onehot) * w``.

    Written as plain tensor ops so that ``torch.compile`` fuses it into two reductions and one
    pointwise pass over the logits (no fp32 [c, V] temporaries); ``w`` carries the accumulation
    dtype (float32, or float64 in the exactness tests). The gradient is returned in the logits'
    dtype.
    """
    lf = logits.to(w.dtype)
    m = lf.amax(dim=-1, keepdim=True)
    e = torch.exp(lf - m)
    s = e.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(s)).squeeze(-1)
    tgt = lf.gather(1, y.unsqueeze(1)).squeeze(1)
    loss = ((lse - tgt) * w).sum()
    onehot = torch.arange(lf.shape[-1], device=lf.device).unsqueeze(0) == y.unsqueeze(1)
    g = (e / s - onehot.to(lf.dtype)) * w.unsqueeze(1)
    return loss, g.to(logits.dtype)


def _softmax_ce_grad_inplace(logits, y, w):
    """Eager twin of ``_softmax_ce_grad`` that reuses one fp32 buffer in place (less memory)."""
    lf = logits.to(w.dtype)
    lse = torch.logsumexp(lf, dim=-1)
    tgt = lf.gather(1, y.unsqueeze(1)).squeeze(1)
    loss = ((lse - tgt) * w).sum()
    lf.sub_(lse.unsqueeze(1)).exp_()
    lf.scatter_add_(1, y.unsqueeze(1), torch.full_like(tgt, -1.0).unsqueeze(1))
    lf.mul_(w.unsqueeze(1))
    return loss, lf.to(logits.dtype)


def _softmax_ce(logits, y, w):
    """Weighted CE sum of one chunk (no gradient)."""
    lf = logits.to(w.dtype)
    lse = torch.logsumexp(lf, dim=-1)
    tgt = lf.gather(1, y.unsqueeze(1)).squeeze(1)
    return ((lse - tgt) * w).sum()


# compiled on CUDA (fused kernels); eager elsewhere. Chunks are padded to the full chunk size
# before the compiled call so that one static-shape graph serves every chunk and every step.
COMPILE_ON_CUDA = True
_compiled_kernel = None
_compile_failed = False


def _kernel_for(t: torch.Tensor):
    global _compiled_kernel
    if not (COMPILE_ON_CUDA and t.is_cuda) or _compile_failed:
        return None
    if _compiled_kernel is None:
        _compiled_kernel = torch.compile(_softmax_ce_grad, dynamic=False)
    return _compiled_kernel


def _chunk_ce_and_grad(h, weight, y, w, want_grad_h, want_grad_w, chunk_rows=None):
    """One chunk: weighted CE sum, and (optionally) d/dh and d/dW of it. Logits computed once."""
    global _compile_failed
    w = w.to(_acc_dtype(h.dtype))
    logits = h @ weight.t()  # [c, V] in the compute dtype
    if not (want_grad_h or want_grad_w):
        return _softmax_ce(logits, y, w), None, None
    kernel = _kernel_for(logits)
    g = None
    if kernel is not None:
        c = logits.shape[0]
        pad = (chunk_rows or c) - c
        try:
            if pad > 0:
                lp = torch.cat([logits, logits.new_zeros(pad, logits.shape[1])])
                loss, g = kernel(lp, torch.cat([y, y.new_zeros(pad)]), torch.cat([w, w.new_zeros(pad)]))
                g = g[:c]
            else:
                loss, g = kernel(logits, y, w)
        except Exception as exc:  # no working compiler: stay correct, lose the fusion
            import sys

            print(f"dflash_loss: torch.compile of the CE kernel failed ({type(exc).__name__}: {exc}); using eager", file=sys.stderr)
            _compile_failed = True
            g = None
    if g is None:
        loss, g = _softmax_ce_grad_inplace(logits, y, w)
    del logits
    gh = g @ weight if want_grad_h else None
    gw = g.t() @ h if want_grad_w else None
    return loss, gh, gw


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_rows, mode, want_h, want_w):
        m = hidden.shape[0]
        acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        total = torch.zeros((), dtype=acc_dtype, device=hidden.device)
        ctx.mode = mode
        ctx.weight_dtype = weight.dtype
        ctx.chunk_rows = chunk_rows
        ctx.want = (want_h, want_w)
        fused = mode == "fused" and (want_h or want_w)
        gh_all = torch.empty_like(hidden) if (fused and want_h) else None
        gw_all = torch.zeros_like(weight, dtype=acc_dtype) if (fused and want_w) else None
        for s in range(0, m, chunk_rows):
            e = min(m, s + chunk_rows)
            loss, gh, gw = _chunk_ce_and_grad(
                hidden[s:e], weight, labels[s:e], weights[s:e], fused and want_h, fused and want_w, chunk_rows
            )
            total += loss
            if gh is not None:
                gh_all[s:e] = gh
            if gw is not None:
                gw_all += gw.to(acc_dtype)
        if fused:
            ctx.save_for_backward(gh_all, gw_all)
        elif want_h or want_w:
            ctx.save_for_backward(hidden, weight, labels, weights)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        want_h, want_w = ctx.want
        if ctx.mode == "fused":
            gh_all, gw_all = ctx.saved_tensors
            gh = gh_all * grad_out.to(gh_all.dtype) if gh_all is not None else None
            gw = gw_all * grad_out.to(gw_all.dtype) if gw_all is not None else None
        else:
            hidden, weight, labels, weights = ctx.saved_tensors
            gh = torch.empty_like(hidden) if want_h else None
            gw = torch.zeros_like(weight, dtype=_acc_dtype(hidden.dtype)) if want_w else None
            for s in range(0, hidden.shape[0], ctx.chunk_rows):
                e = min(hidden.shape[0], s + ctx.chunk_rows)
                _, ghc, gwc = _chunk_ce_and_grad(hidden[s:e], weight, labels[s:e], weights[s:e], want_h, want_w, ctx.chunk_rows)
                if ghc is not None:
                    gh[s:e] = ghc
                if gwc is not None:
                    gw += gwc.to(gw.dtype)
            if gh is not None:
                gh = gh * grad_out.to(gh.dtype)
            if gw is not None:
                gw = gw * grad_out.to(gw.dtype)
        if gw is not None:
            gw = gw.to(ctx.weight_dtype)  # accumulated in float32, returned in the weight's dtype
        return gh, gw, None, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_rows: int = 2048,
    mode: str = "fused",
) -> torch.Tensor:
    """Return ``sum_i weights[i] * CE(hidden[i] @ weight.T, labels[i])`` (float32 scalar; float64 for float64 input).

    ``hidden`` [M, H], ``weight`` [V, H] (an lm_head weight, frozen or not), ``labels`` [M] long,
    ``weights`` [M] float. Never materialises more than ``chunk_rows`` rows of logits. ``mode`` is
    ``"fused"`` (gradients computed during the forward pass) or ``"recompute"`` (checkpointed chunks).
    """
    if mode not in ("fused", "recompute"):
        raise ValueError(f"mode must be 'fused' or 'recompute', not {mode!r}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    weights = weights.reshape(-1)
    grad_on = torch.is_grad_enabled()
    want_h = bool(grad_on and hidden.requires_grad)
    want_w = bool(grad_on and weight.requires_grad)
    return _ChunkedLinearCE.apply(hidden, weight, labels, weights, int(chunk_rows), mode, want_h, want_w)


def plain_linear_cross_entropy(hidden, weight, labels, weights) -> torch.Tensor:
    """Reference: the full logits, then ``sum(w * CE)`` (float32 math)."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    acc = _acc_dtype(hidden.dtype)
    ce = F.cross_entropy(logits.to(acc), labels.reshape(-1), reduction="none")
    return (ce * weights.reshape(-1).to(acc)).sum()


def dflash_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_rows: int = 2048,
    mode: str = "fused",
    compact: bool = True,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(loss, weight_sum)`` with loss = sum(w*CE)/sum(w) over the drafter's block outputs.

    With ``normalize=False`` the loss is the sum ``sum(w*CE)`` (to be normalised globally,
    ``finish_global_mean``).

    ``hidden`` [b, N*B, H] (drafter output after the final norm), ``labels``/``weights`` [b, N, B].
    With ``compact`` rows of zero weight (slot 0, padding, masked labels) are dropped before the
    lm_head, which saves 1/B of the work for free.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    w = weights.reshape(-1).to(torch.float32 if hidden.dtype != torch.float64 else torch.float64)
    if compact:
        idx = (w > 0).nonzero(as_tuple=True)[0]
        h, y, w = h.index_select(0, idx), y.index_select(0, idx), w.index_select(0, idx)
    wsum = w.sum()
    if mode == "plain":
        total = plain_linear_cross_entropy(h, lm_head_weight, y, w)
    else:
        total = chunked_linear_cross_entropy(h, lm_head_weight, y, w, chunk_rows=chunk_rows, mode=mode)
    if not normalize:
        return total, wsum
    return total / wsum.clamp(min=1e-12), wsum


def finish_global_mean(
    parameters, loss_sum, weight_sum, group=None, world: int = 1, extra: list[float] | None = None
) -> tuple[float, float, list[float]]:
    """Make accumulated gradients of weighted-CE *sums* those of the global mean; return the global figures.

    ``loss_sum``/``weight_sum``: this rank's totals over its micro-batches (tensors or floats).
    One SUM all-reduce over ``group`` (when ``world > 1``) carries them and ``extra`` (e.g. a stop
    vote). The gradients, which FSDP averaged over the ``world`` ranks, are multiplied by
    ``world / global weight sum``. Returns ``(global loss, global weight sum, reduced extra)``.
    """
    import torch.distributed as dist

    extra = list(extra or [])
    vals = [float(loss_sum), float(weight_sum), *map(float, extra)]
    params = [p for p in parameters if p.grad is not None]
    dev = params[0].grad.device if params else torch.device("cpu")
    t = torch.tensor(vals, dtype=torch.float64, device=dev)
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    total, wsum, *rest = t.tolist()
    if wsum <= 0:
        raise ValueError("no supervised position in this step on any rank (global loss weight is 0)")
    scale = world / wsum
    for p in params:
        p.grad.mul_(scale)
    return total / wsum, wsum, rest


@torch.no_grad()
def simulated_acceptance(hidden, lm_head_weight, labels, weights, block_size) -> float:
    """Mean simulated acceptance length over valid blocks: 1 + sum_k cumprod(pred_k == label_k)."""
    bsz = labels.shape[0]
    h = hidden.reshape(bsz, -1, block_size, hidden.shape[-1])[:, :, 1:]
    pred = (h @ lm_head_weight.t()).argmax(-1)
    ok = (pred == labels[:, :, 1:]) & (weights[:, :, 1:] > 0)
    acc = ok.long().cumprod(-1).sum(-1) + 1
    valid = weights[:, :, 1] > 0
    if not bool(valid.any()):
        return float("nan")
    return float(acc[valid].float().mean().item())


__all__ = [
    "valid_anchor_mask",
    "sample_anchors",
    "block_inputs",
    "build_attention_mask",
    "visible_keys",
    "labels_and_weights",
    "chunked_linear_cross_entropy",
    "plain_linear_cross_entropy",
    "dflash_loss",
    "finish_global_mean",
    "simulated_acceptance",
]
