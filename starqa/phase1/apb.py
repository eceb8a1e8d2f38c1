"""APB Phase 1 (docs/methods.md §4): a small anchor, and compressed KV passed between hosts.

Block 0 is encoded alone. Block i > 0 is encoded as [A ‖ B_i] with the anchor
A = [question ‖ c[:l_a]] at positions 0..|A|-1 and B_i at its own positions. In every layer
each block keeps the `passing` most useful keys of its own KV per KV head (`compress`), and
block i also attends to those of every earlier block (the passing block P_i, RoPE already
applied at their original positions):

    keys  [A ‖ P_i ‖ B_i]      anchor rows see A causally (not P_i);
                               block rows see A and P_i fully and B_i causally (`layout_mask`)

P_i lives only inside that layer's attention: it is never fed through the MLP nor cached;
only B_i's KV is kept. Phase 2 is Star's.

The compressor is the training-free, query-aware score (the paper's retaining heads are
trained; we have none): average the probe's queries over each GQA group, score every key
s = mean_probe(q · k), smooth with a max-pool of width 5, keep the top `passing` in
positional order. The probe is the question when it is known at encoding time, and the
block's last `window` tokens otherwise, so the cache stays reusable across questions.

Distributed, block i runs on worker i mod W in round i // W (`assignment`): every block an
earlier round encoded is already compressed, and the blocks of this round reach each other
through one all-gather per layer. Each block only reads earlier blocks, so a world of one
(every block in order, in one process) reproduces the workers' result exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from starqa.runtime import dist
from starqa.attention import causal_attention
from starqa.phase1.blockwise import stack_layers
from starqa.core.blocks import round_robin

Blocks = Sequence[tuple[int, int]]
KV = tuple[torch.Tensor, torch.Tensor]
# exchange(layer, k, v) -> the passing block (k, v) [1, Hkv, P, D] of every earlier block
Exchange = Callable[[int, torch.Tensor, torch.Tensor], KV]


@dataclass(frozen=True)
class ApbSettings:
    """What one APB encoding is given besides the model and the blocks."""

    anchor: int  # l_a: the context's first tokens in every block's anchor (after the question)
    passing: int  # keys each block passes on, per layer and KV head
    window: int = 64  # without a question, the probe is the block's last `window` tokens
    pool: int = 5  # max-pool width of the key scores (`key_scores`)
    # The question's token ids when known at encoding time: they open every anchor and are
    # the probe; () leaves the cache reusable across questions.
    question_ids: tuple[int, ...] = ()


def assignment(n_blocks: int, world: int, rank: int) -> list[int]:
    """Blocks of `rank`, round-robin: block i on worker i % world, in round i // world."""
    return round_robin(n_blocks, world, rank)


# ------------------------------------------------------------------------- pure pieces


def layout_mask(anchor: int, passing: int, block: int, device=None) -> torch.Tensor:
    """Boolean mask [anchor + block, anchor + passing + block] over keys [A ‖ P ‖ B], True
    where a query row may attend: anchor rows see the anchor causally and never P; block
    rows see all of A and P, and B causally."""
    rows, cols = anchor + block, anchor + passing + block
    mask = torch.zeros(rows, cols, dtype=torch.bool, device=device)
    mask[:anchor, :anchor] = torch.ones(anchor, anchor, dtype=torch.bool, device=device).tril()
    mask[anchor:, :anchor + passing] = True
    mask[anchor:, anchor + passing:] = torch.ones(block, block, dtype=torch.bool,
                                                  device=device).tril()
    return mask


def key_scores(probe: torch.Tensor, key: torch.Tensor, pool: int = 5) -> torch.Tensor:
    """Query-aware score of every key: probe [1, Hq, W, D], key [1, Hkv, T, D] -> [1, Hkv, T].

    s = mean over the probe rows and the GQA group's query heads of q · k (the mean of the
    dot products is the dot product with the mean query), then a max-pool of width `pool`
    (stride 1, same length) so a chosen key brings its neighbours' scores along.
    """
    batch, q_heads, rows, dim = probe.shape
    kv_heads = key.shape[1]
    mean_q = probe.float().reshape(batch, kv_heads, q_heads // kv_heads * rows, dim).mean(2)
    scores = torch.einsum("bhd,bhtd->bht", mean_q, key.float())
    if pool > 1:
        scores = F.max_pool1d(scores, pool, stride=1, padding=pool // 2)
    return scores


def compress(probe: torch.Tensor, key: torch.Tensor, value: torch.Tensor, passing: int,
             pool: int = 5) -> KV:
    """The top-`passing` keys and values per KV head by `key_scores`, in positional order:
    [1, Hkv, min(passing, T), D] each."""
    keep = min(passing, key.shape[2])
    top = key_scores(probe, key, pool).topk(keep, dim=-1).indices.sort(dim=-1).values
    index = top.unsqueeze(-1).expand(-1, -1, -1, key.shape[-1])
    return key.gather(2, index), value.gather(2, index)


# --------------------------------------------------------------------------- the hook


class _ApbHook:
    """AttentionHook for one block's forward over [A ‖ B]; keeps B's KV per layer."""

    def __init__(self, anchor: int, probe_rows: slice, passing: int, pool: int,
                 exchange: Exchange):
        self.anchor = anchor
        self.probe_rows = probe_rows
        self.passing = passing
        self.pool = pool
        self.exchange = exchange
        self.kept: list[KV] = []

    def attention(self, layer, query, key, value, scale):
        a = self.anchor
        block_k, block_v = key[:, :, a:], value[:, :, a:]
        self.kept.append((block_k, block_v))
        mine = compress(query[:, :, self.probe_rows], block_k, block_v, self.passing, self.pool)
        passing_k, passing_v = self.exchange(layer, *mine)
        if a == 0 and passing_k.shape[2] == 0:  # block 0: plain causal attention
            return causal_attention(query, key, value, scale)
        keys = torch.cat([key[:, :, :a], passing_k.to(key.dtype), block_k], dim=2)
        values = torch.cat([value[:, :, :a], passing_v.to(value.dtype), block_v], dim=2)
        mask = layout_mask(a, passing_k.shape[2], key.shape[2] - a, query.device)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=query.shape[1] != key.shape[1])


def _encode_block(model, ids: torch.Tensor, blocks: Blocks, i: int, settings: ApbSettings,
                  question: torch.Tensor, exchange: Exchange) -> KV:
    """One block's forward (`question`: settings.question_ids as int64 [Q]); returns its KV
    [L, Hkv, T, D]."""
    device = next(model.parameters()).device
    start, end = blocks[i]
    anchor_ids = (torch.cat([question, ids[:min(settings.anchor, start)]]) if i > 0
                  else ids[:0])  # block 0 is encoded alone
    a = len(anchor_ids)
    tokens = torch.cat([anchor_ids, ids[start:end]]).to(device)
    positions = torch.cat([torch.arange(a), torch.arange(start, end)]).to(device)
    # The probe: the question's rows when it sits in this forward, else the last `window`.
    if i > 0 and len(question):
        probe = slice(0, len(question))
    else:
        probe = slice(max(a, len(tokens) - settings.window), None)
    hook = _ApbHook(a, probe, settings.passing, settings.pool, exchange)
    model.model(input_ids=tokens[None], position_ids=positions[None], starqa=hook, use_cache=False)
    return stack_layers(hook.kept)


class _RoundExchange:
    """Per-layer all-gather of this round's compressed blocks, plus every earlier round's."""

    def __init__(self, info: dist.DistInfo, lengths: Sequence[int]):
        self.info = info
        self.lengths = lengths  # compressed length of every block
        self.history: dict[int, list[KV]] = {}
        self.round = 0

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KV:
        world, rank = self.info.world_size, self.info.rank
        width = max(self.lengths)
        sent = F.pad(torch.stack([k, v]), (0, 0, 0, width - k.shape[2]))  # [2, 1, Hkv, P, D]
        gathered = dist.all_gather(self.info, sent)  # [W, 2, 1, Hkv, P, D]
        earlier = self.history.setdefault(layer, [])
        result = earlier[:]
        for w in range(world):
            index = self.round * world + w
            if index >= len(self.lengths):
                break
            part = gathered[w, :, :, :, :self.lengths[index]]
            earlier.append((part[0], part[1]))
            if w < rank:
                result.append((part[0], part[1]))
        return (torch.cat([e[0] for e in result] or [k[:, :, :0]], dim=2),
                torch.cat([e[1] for e in result] or [v[:, :, :0]], dim=2))

    def idle(self, n_layers: int, like: torch.Tensor) -> None:
        """Take part in a round without a block of our own (the last round may be short)."""
        for layer in range(n_layers):
            self(layer, like, like)


@torch.inference_mode()
def encode_apb(model, ids: torch.Tensor, blocks: Blocks, indices: Sequence[int],
               info: dist.DistInfo, settings: ApbSettings
               ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """This worker's blocks (`assignment`), encoded round by round with every worker of the
    group; yields (index, k, v). All workers must call it together."""
    world = info.world_size
    if list(indices) != assignment(len(blocks), world, info.rank):
        raise ValueError("apb blocks must be assigned round-robin (apb.assignment)")
    lengths = [min(settings.passing, end - start) for start, end in blocks]
    exchange = _RoundExchange(info, lengths)
    question = torch.tensor(list(settings.question_ids), dtype=torch.long)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    for r in range(-(-len(blocks) // world)):
        exchange.round = r
        i = r * world + info.rank
        if i < len(blocks):
            yield (i, *_encode_block(model, ids, blocks, i, settings, question, exchange))
        else:
            empty = torch.zeros(1, config.num_key_value_heads, 0, head_dim, dtype=dtype,
                                device=device)
            exchange.idle(config.num_hidden_layers, empty)
