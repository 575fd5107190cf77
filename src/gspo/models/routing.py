"""Mixture-of-Experts routing: record which experts each token uses, measure how many change
between π_old and π_θ, and Routing Replay.

GSPO's stability claim on MoE models (paper §2.3 / §5.3) is that about 10% of routes change
after one gradient update, which moves GRPO's token ratios but barely moves GSPO's sequence
ratio. `RouteTracker` makes that measurable on any Hugging Face MoE whose routers follow
transformers' `*TopKRouter` contract (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and ~25 others; the
DeepSeek-V2/V3 line's `*TopkRouter` too, for route metrics and R3):
``router(h) -> (logits (n, E), scores (n, k), indices (n, k))``. Llama 4's router returns
(scores (n, E), logits (n, E)) instead; its experts are read from the logits as it picks them
(`dense_scores`), and replay writes its sigmoid gates back in that form.

- `capture`: the π_old pass records each real token's top-k experts per MoE layer, in rollout
  coordinates (row, column of ``[prompt | completion]``), so that any later micro-batch split
  finds the same token's routes.
- `compare`: in the update pass, each token's natural top-k under π_θ is compared with π_old's;
  ``routing/changed_frac`` is the fraction of (token, layer, k) choices that differ (top-k sets,
  order ignored), with a per-layer breakdown.
- `recorder` (R3, async mode): the sampler's decode loop records the routes of its own forward
  instead, sent with the rollout (`gspo.rollout.Rollout.routes`) and used by `compare` and
  `replay` through `use_sampler_routes`.
- `replay` (``algo.routing_replay``): the update pass uses π_old's experts for every token; the
  gate weights of those experts are recomputed from π_θ's router logits (softmax, then the
  router's own top-k renormalisation), so gradients still reach the router. The rule is checked
  against each router's own output on its first call.
- `take_aux` (``algo.router_aux_loss_coef``): the load-balancing loss of the Switch Transformer
  (Fedus et al. 2021) in transformers' top-k form, E · Σ_e f_e · P_e over every layer's real
  tokens of the update pass, where f_e is the number of times expert e is among a token's
  natural top-k, per token, and P_e the mean router probability of e (k when the load is
  uniform). A prompt run once for its group counts once per row, as in the unshared forward.

Memory: the recorded routes are int16 (int32 for > 32k experts) of shape (N, P+T, layers, k)
on the model's device, e.g. 256 sequences × 1,024 tokens × 48 layers × 8 = 200 MB.
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager, nullcontext

import torch

from gspo.config import ConfigError


def find_routers(model) -> list[torch.nn.Module]:
    """The MoE routers of `model`, in layer order (empty for a dense model): transformers'
    ``*TopKRouter`` modules and the ``*TopkRouter`` ones of the DeepSeek-V2/V3 line (GLM-4.5 MoE,
    Kimi, dots1, …), which have the same contract but gate with a sigmoid over expert groups, and
    Llama 4's ``Llama4Router`` (`dense_scores`)."""
    return [m for m in model.modules()
            if (type(m).__name__.lower().endswith("topkrouter") or dense_scores(m))
            and hasattr(m, "top_k") and hasattr(m, "num_experts")]


def dense_scores(router) -> bool:
    """Whether `router` is Llama 4's kind: an `nn.Linear` subclass named ``*Router`` that returns
    (scores (n, E), logits (n, E)), its k experts picked by ``topk`` of the logits and gated by a
    sigmoid of theirs, every other expert's score 0 (`_dense_replay_scores`)."""
    return (isinstance(router, torch.nn.Linear) and type(router).__name__.lower().endswith("router")
            and not type(router).__name__.lower().endswith("topkrouter"))


def no_routers(model) -> str:
    """Why `find_routers` found none, for an error message: a dense model, or a MoE whose routers
    are not transformers' TopKRouter modules (HunYuan-MoE, JetMoE, DBRX), which gspo cannot hook."""
    moe = sorted({type(m).__name__ for m in model.modules()
                  if any(w in type(m).__name__.lower() for w in ("moe", "expert", "router"))})
    if not moe:
        return "the model has no MoE routers"
    return (f"gspo finds no router it can hook in this MoE ({', '.join(moe[:4])}): it hooks transformers' "
            "TopKRouter modules (Qwen-MoE, Mixtral, OLMoE, DeepSeek, GLM-MoE, gpt-oss, ...) and Llama 4's router")


def _replay_scores(router, logits: torch.Tensor, idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Gate weights of the experts `idx` (n, k) from the router logits (n, E): softmax over all
    experts, then renormalised over the chosen k when the router does that."""
    w = torch.softmax(logits.float(), dim=-1).gather(-1, idx.long())
    if getattr(router, "norm_topk_prob", True):
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
    return w.to(like.dtype)


@torch.no_grad()  # (a check, run once: nothing of it may enter the graph that a checkpoint recomputes)
def _gated_by_rule(router, logits: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor, dense: bool) -> bool:
    """Whether the router's gate weights are replay's rule on its own output: `_dense_replay_scores`
    for a router with `dense_scores`, else `_replay_scores` (softmax, top-k renormalisation)."""
    if dense:
        rule = _dense_replay_scores(logits, idx, scores)
    elif scores.shape != idx.shape:
        return False
    else:
        rule = _replay_scores(router, logits, idx, scores)
    return torch.allclose(rule.float(), scores.float(), atol=1e-3, rtol=1e-3)


def _dense_replay_scores(logits: torch.Tensor, idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Llama 4's gate weights (n, E) for the experts `idx` (n, k): the sigmoid of each chosen
    expert's logit, 0 for the others (the sigmoid of -inf)."""
    picked = torch.full_like(logits, float("-inf")).scatter(1, idx.long(), logits.gather(1, idx.long()))
    return torch.sigmoid(picked.float()).to(like.dtype)


def _as_topk(router, output, k: int):
    """(logits, scores, experts, dense) of a router's output: transformers' TopKRouter contract
    (logits, weights (n, k), experts (n, k)) as it is, or, for a router with `dense_scores`,
    (scores (n, E), logits (n, E)) with its experts taken from the logits as it takes them
    (None when the output is neither)."""
    if isinstance(output, tuple) and len(output) == 3:
        return (*output, False)
    if (dense_scores(router) and isinstance(output, tuple) and len(output) == 2
            and all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in output) and output[0].shape == output[1].shape):
        scores, logits = output
        return logits, scores, torch.topk(logits.detach(), k, dim=-1).indices, True
    return None


def _check_rule(router, logits, idx, scores, dense: bool, *, replay: bool, aux: bool) -> None:
    """One ConfigError naming the field when `router`'s gates are not the rule that Routing Replay
    (`replay`) or the Switch load-balancing loss (`aux`) needs."""
    if aux and (dense or not _gated_by_rule(router, logits, idx, scores, dense=False)):
        raise ConfigError(f"config field 'algo.router_aux_loss_coef': {type(router).__name__} does not gate with a "
                          "softmax over its logits (sigmoid routing, as in DeepSeek-V3 and Llama 4), so the Switch "
                          "load-balancing loss is not defined for it; set it to 0")
    if replay and not _gated_by_rule(router, logits, idx, scores, dense):
        rule = "top-k sigmoid" if dense else "softmax + top-k renormalisation"
        raise ConfigError(f"config field 'algo.routing_replay': {type(router).__name__} computes gate weights in a "
                          f"way gspo does not reproduce ({rule}); replay is off limits for this model")


_TRACKERS: weakref.WeakSet = weakref.WeakSet()  # every RouteTracker with hooks on a model


def recompute_contexts():
    """torch.utils.checkpoint's `context_fn` (`gspo.models.set_activation_checkpointing`): at a
    checkpointed layer's forward, the state of every tracker in a pass now, put back around the
    layer's recomputation in the backward pass, where the tracker's forward context is long
    closed. The router hooks then compute in the recomputation what they computed in the
    forward (replay's gate weights, the load-balancing terms, so that torch finds the same
    saved tensors), and record and count nothing a second time."""
    live = [(t, t._state()) for t in list(_TRACKERS) if t._mode is not None]
    return nullcontext(), (_recomputing(live) if live else nullcontext())


@contextmanager
def _recomputing(live: list):
    before = [(t, t._state(), t._recompute) for t, _ in live]
    for t, state in live:
        t._set_state(state)
        t._recompute = True
    try:
        yield
    finally:
        for t, state, again in before:
            t._set_state(state)
            t._recompute = again


class RouteTracker:
    """Hooks on every router of a MoE model; inactive (no effect) outside `capture` / `compare`."""

    def __init__(self, model):
        self.routers = find_routers(model)
        self.k = self.routers[0].top_k if self.routers else 0
        n_exp = max((r.num_experts for r in self.routers), default=0)
        self.dtype = torch.int16 if n_exp < 2**15 else torch.int32
        self.routes: torch.Tensor | None = None  # (N, L, layers, k) π_old's experts, -1 unknown
        self._mode = None  # None | "capture" | "compare"
        self._replay = False
        self._slot = None  # (rows (b,), column offset, mask (b, l), fan-out) of the current decoder call
        self._whole = None  # the slot of the whole forward
        self._changed = torch.zeros(len(self.routers), dtype=torch.float64)
        self._total = torch.zeros(len(self.routers), dtype=torch.float64)
        self._checked: set[int] = set()
        self.aux = False  # accumulate the load-balancing loss's sums in forwards with autograd on
        self._aux_sums: list = []  # per router call: (Σ w·probs (E,), Σ w·picks (E,), Σ w)
        self.partial = False  # routes with unknown tokens that replay may leave alone (the sampler's)
        self._recompute = False  # in a checkpointed layer's recomputation (`recompute_contexts`)
        self._handles = [r.register_forward_hook(self._hook_for(i)) for i, r in enumerate(self.routers)]
        if self.routers:
            _TRACKERS.add(self)

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        _TRACKERS.discard(self)

    @torch.no_grad()
    def check_rules(self, model, *, replay: bool, aux: bool) -> None:
        """At start-up, before any sampling: one forward of four tokens through `model`, and each
        router's gates checked against what Routing Replay (`replay`) or the load-balancing loss
        (`aux`) needs, so that a router they cannot serve is one error naming the field at once,
        not in the first update pass after a rollout's compute (every process of a sharded model
        runs it together)."""
        seen: dict[int, tuple] = {}

        def keep(i: int):
            def hook(module, args, out):
                seen.setdefault(i, (module, out))  # (returns None: the output stays as it is)
            return hook

        handles = [r.register_forward_hook(keep(i)) for i, r in enumerate(self.routers)]
        try:
            device = next(model.parameters()).device
            vocab = model.get_input_embeddings().num_embeddings
            model(input_ids=torch.arange(1, 5, device=device)[None] % vocab)
        finally:
            for h in handles:
                h.remove()
        for i, (module, out) in seen.items():
            read = _as_topk(module, out, self.k)
            if read is not None:
                logits, scores, idx, dense = read
                _check_rule(module, logits, idx, scores, dense, replay=replay, aux=aux)
                self._checked.update([i] * replay + [("aux", i)] * aux)  # (the update pass need not check again)

    def _state(self) -> tuple:
        return self._mode, self._replay, self._slot, self._whole

    def _set_state(self, state: tuple) -> None:
        self._mode, self._replay, self._slot, self._whole = state

    # ------------------------------------------------------------------ bookkeeping

    def reset(self, n_rows: int, n_cols: int, device) -> None:
        """A new rollout of `n_rows` × `n_cols` tokens: forget the old routes."""
        self.routes = torch.full((n_rows, n_cols, len(self.routers), self.k), -1, dtype=self.dtype, device=device)
        self.partial = False

    def use_sampler_routes(self, routes: torch.Tensor) -> None:
        """π_old's routes are the sampler's (R3: `Rollout.routes`, recorded in its decode loop).
        Each row's last token has none: the sampler never ran it. Its routes cannot change any
        log-prob (a causal model reads a token's hidden state only at later positions), so
        replay leaves that token its own choice and `routing/changed_frac` skips it."""
        self.routes, self.partial = routes, True

    @contextmanager
    def forward(self, mode: str, rows: torch.Tensor, col_offset: int, mask: torch.Tensor, *, replay: bool = False):
        """Around one trainer forward of the rows `rows` (rollout indices), whose input column 0
        is rollout column `col_offset`; `mask` (b, l) marks real tokens. A forward that
        `gspo.models.logprobs` splits into a call over each distinct prompt and one over the completions
        (``model.share_prompt``) announces its calls, and each is mapped back to these rows."""
        from gspo.models.logprobs import announce_body_calls

        self._mode, self._replay = mode, replay
        self._slot = (rows.to(mask.device), col_offset, mask.bool(), None)
        self._whole = self._slot
        try:
            with announce_body_calls(self._on_body_call):
                yield
        finally:
            self._mode, self._slot, self._whole, self._replay = None, None, None, False

    def recorder(self, row_start: int, col_start: int):
        """For the sampler's decode loop (`gspo.rollout.hf.decode`'s `on_forward`): record the routes
        of each forward of a chunk whose row 0 is rollout row `row_start` and whose column 0 is
        rollout column `col_start`. Each row's last token is never run through the model (its
        successor is not sampled), so its routes stay unknown (-1)."""
        self._mode = "capture"

        def on_forward(rows, col, mask, fan_out):
            dev = mask.device
            run_rows = rows.to(dev) + row_start
            fan = None
            if fan_out is not None:  # the prefill: each distinct prompt once, for every row of its group
                fan = (torch.arange(fan_out.shape[0], device=dev) + row_start, fan_out.to(dev))
            self._slot = (run_rows, col_start + col, mask.bool(), fan)

        return on_forward

    def stop_recording(self) -> None:
        self._mode, self._slot = None, None

    def _on_body_call(self, rows, col_start, mask, fan_out) -> None:
        """One decoder-body call of a split forward (see `gspo.models.logprobs.announce_body_calls`)."""
        all_rows, off, _, _ = self._whole
        if mask is None:  # the split forward is over
            self._slot = self._whole
            return
        run_rows = all_rows if rows is None else all_rows[rows.to(all_rows.device)]
        fan = None if fan_out is None else (all_rows, fan_out.to(mask.device))
        self._slot = (run_rows, off + col_start, mask.bool(), fan)

    def take_metrics(self, per_layer: bool = False, captured: bool = False) -> dict:
        """`routing/changed_frac` (and per layer) since the last call, NaN where nothing was
        compared (the same keys on every process: a process whose rows all had advantage 0
        compared none). `captured`: the routes were captured in this step's own forward
        (π_θ = π_old), so every fraction is 0 by definition."""
        if captured:
            self._total.fill_(1.0)
        total = self._total.sum().item()
        out = {"routing/changed_frac": self._changed.sum().item() / total if total else math.nan}
        if per_layer:
            for i in range(len(self.routers)):
                t = self._total[i].item()
                out[f"routing/changed_frac/layer_{i}"] = self._changed[i].item() / t if t else math.nan
        self._changed.zero_()
        self._total.zero_()
        return out

    def take_aux(self) -> torch.Tensor | None:
        """The load-balancing loss over the router calls since the last call (a 0-dim tensor with
        the routers' gradient; None when none ran, e.g. a placeholder forward)."""
        sums, self._aux_sums = self._aux_sums, []
        if not sums:
            return None
        p, f, w = (sum(s[i] for s in sums) for i in range(3))  # Σ w·probs (E,), Σ w·picks (E,), Σ w
        return p.shape[-1] * (f * p).sum() / (w * w)

    def _add_aux(self, logits: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor, fan) -> None:
        """One router call's share of `take_aux`: its real tokens, weighted by how many rows
        each stands for (a prompt run once for its group: every row of the group)."""
        b = mask.shape[0]
        w = mask.to(torch.float32)
        if fan is not None:
            w = w * torch.bincount(fan[1].to(mask.device), minlength=b).to(w)[:, None]
        w = w.reshape(-1)  # (n,)
        probs = torch.softmax(logits.float(), dim=-1)  # (n, E)
        picks = torch.zeros(probs.shape[-1], dtype=w.dtype, device=w.device)
        picks.scatter_add_(0, idx.reshape(-1).long(), w.repeat_interleave(idx.shape[-1]))
        sums = ((w[:, None] * probs).sum(0), picks, w.sum())
        if not self._recompute:  # (recomputed for torch's checkpoint: counted once, in the forward)
            self._aux_sums.append(sums)

    # ------------------------------------------------------------------ the hook

    def _coords(self, rows, off, mask):
        """Rollout (row, column) of each real token of a (b, l) forward, in flattened order."""
        b, length = mask.shape
        cols = torch.arange(off, off + length, device=mask.device)
        flat_mask = mask.reshape(-1)  # (b*l,)
        return (rows[:, None].expand(b, length).reshape(-1)[flat_mask],
                cols[None, :].expand(b, length).reshape(-1)[flat_mask], flat_mask)

    def _last_tokens(self, r_idx: torch.Tensor, c_idx: torch.Tensor) -> torch.Tensor:
        """(m,) bool: which of these tokens (rollout coordinates) is its row's last real token in
        the current forward. A forward never runs the last column (it predicts nothing), so
        the π_old pass records no route for the last token of a row that was the longest of its
        forward, while another forward, where the row is shorter than the widest, runs it. Its
        hidden state is read by no later position, so no log-prob depends on its route: replay
        leaves it its own choice, as for the sampler's routes (`use_sampler_routes`)."""
        rows, off, mask, _ = self._whole
        last = off + mask.shape[1] - 1 - mask.flip(1).int().argmax(1)  # (b,) each row's last real column
        lookup = torch.full((self.routes.shape[0],), -1, dtype=torch.long, device=last.device)
        lookup[rows.to(last.device)] = last.long()
        return c_idx.to(last.device) == lookup[r_idx.to(last.device)]

    def _hook_for(self, layer: int):
        def hook(module, args, output):
            if self._mode is None:
                return None
            read = _as_topk(module, output, self.k)
            if read is None:  # not the contract: not tracked
                if self._replay or (self.aux and torch.is_grad_enabled()):
                    raise RuntimeError(f"{type(module).__name__} does not return (logits, weights, experts), "
                                       "which Routing Replay and the load-balancing loss read")
                return None
            logits, scores, idx, dense = read
            rows, off, mask, fan = self._slot
            b, length = mask.shape
            if idx.shape[0] != b * length:  # not this slot's forward (e.g. a one-off probe): leave it
                return None
            if self.aux and torch.is_grad_enabled():
                if ("aux", layer) not in self._checked:  # the loss reads softmax gate probabilities
                    _check_rule(module, logits, idx, scores, dense, replay=False, aux=True)
                    self._checked.add(("aux", layer))
                self._add_aux(logits, idx, mask, fan)
            if self.routes is None or (self._recompute and not self._replay):  # (a recomputation records and
                return None  # counts nothing: only replay changes what it computes)
            r_idx, c_idx, flat_mask = self._coords(rows, off, mask)
            # the tokens the routes stand for: those run, or, for a prompt run once for its
            # group, the same prompt tokens of every row of the group (identical routes)
            if fan is None:
                t_rows, t_cols, t_new = r_idx, c_idx, idx[flat_mask]
            else:
                all_rows, inverse = fan
                t_rows, t_cols, fan_mask = self._coords(all_rows, off, mask[inverse])
                t_new = idx.view(b, length, -1)[inverse].reshape(-1, idx.shape[-1])[fan_mask]
            if self._mode == "capture":
                if not self._recompute:
                    self.routes[t_rows, t_cols, layer] = t_new.to(self.dtype)
                return None
            old_t = self.routes[t_rows, t_cols, layer].long()  # (m, k)
            if not self._recompute:
                known = (old_t >= 0).all(-1)
                same = (t_new.long()[:, :, None] == old_t[:, None, :]).any(-1).sum(-1)  # (m,) shared experts
                self._changed[layer] += (self.k - same[known]).sum().item()
                self._total[layer] += self.k * known.sum().item()
            if not self._replay:
                return None
            old = old_t if fan is None else self.routes[r_idx, c_idx, layer].long()  # the tokens run
            unknown = (old < 0).any(-1)
            if unknown.any():
                if not self.partial and (unknown & ~self._last_tokens(r_idx, c_idx)).any():
                    raise RuntimeError("Routing Replay: a token has no recorded π_old route "
                                       "(replay needs the trainer's π_old pass over the same rollout)")
                old = torch.where(unknown[:, None], idx[flat_mask].long(), old)  # (see `_last_tokens`)
            if layer not in self._checked:  # the gate-weight rule must reproduce this router
                _check_rule(module, logits, idx, scores, dense, replay=True, aux=False)
                self._checked.add(layer)
            rep_idx = idx.clone()
            rep_idx[flat_mask] = old.to(idx.dtype)
            if dense:
                return _dense_replay_scores(logits, rep_idx, scores), logits
            return logits, _replay_scores(module, logits, rep_idx, scores), rep_idx

        return hook
