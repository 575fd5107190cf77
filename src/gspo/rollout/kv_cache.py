"""The decode loop's KV cache (`gspo.rollout.hf.decode`): transformers' DynamicCache with its
full-attention layers writing into buffers allocated once, instead of concatenating the whole
cache at every step (O(T^2) copying over a completion; bench/decode_cache.py measures it), and
`select_rows`, which keeps a subset of the rows in every kind of layer the cache holds: key/value
layers and the recurrent states of hybrid models' linear-attention layers (Qwen3.5, Qwen3-Next,
LFM2, ...)."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gspo.models import holds_recurrent_state


class BufferLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views of (b, heads, capacity, d) buffers: `update`
    writes the new positions in place (reallocating only if `capacity` is ever short), and
    `batch_select_indices` keeps the rows still decoding. Those are the two operations
    `decode` uses; it owns the cache, so nothing else runs on it."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._k = self._v = None
        self._n = 0

    def _view(self):
        self.keys, self.values = self._k[..., : self._n, :], self._v[..., : self._n, :]
        return self.keys, self.values

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self._n + key_states.shape[-2]
        if self._k is None or n > self._k.shape[-2]:
            size = max(n, self.capacity)
            k = key_states.new_empty((*key_states.shape[:-2], size, key_states.shape[-1]))
            v = value_states.new_empty((*value_states.shape[:-2], size, value_states.shape[-1]))
            if self._n:
                k[..., : self._n, :], v[..., : self._n, :] = self.keys, self.values
            self._k, self._v = k, v
        self._k[..., self._n : n, :] = key_states
        self._v[..., self._n : n, :] = value_states
        self._n = n
        return self._view()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._n:
            self._k, self._v = self._k[indices], self._v[indices]
            self._view()


def preallocated_cache(model, capacity: int) -> DynamicCache:
    """A DynamicCache for `model` whose full-attention layers are `BufferLayer`s of `capacity`
    positions; other layer kinds (sliding windows) stay as transformers builds them."""
    cache = DynamicCache(config=getattr(model, "config", None))
    if cache.layers:
        cache.layers = [BufferLayer(capacity) if type(x) is DynamicLayer else x for x in cache.layers]
    elif getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = lambda: BufferLayer(capacity)
    return cache


def select_rows(cache: DynamicCache, indices: torch.Tensor) -> None:
    """Keep rows `indices` (in that order, repeats allowed) of every layer of `cache`.

    transformers' ``Cache.batch_select_indices`` does this for key/value layers only: a
    linear-attention layer has no such method, and a layer that holds both kinds would keep
    every row of its recurrent state. Their ``reorder_cache`` selects rows of each state the
    layer holds (conv, recurrent, and keys/values where it has them), so it serves here."""
    for layer in cache.layers:
        if holds_recurrent_state(layer):
            layer.reorder_cache(indices)
        else:
            layer.batch_select_indices(indices)
