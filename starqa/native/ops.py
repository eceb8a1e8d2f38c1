"""starqa's compiled CPU kernels on torch tensors (starqa/native/_attend.c: exact attention;
starqa/native/_topk_*.c: top-k attention; starqa/native/_int4.c: int4 weights times a few
rows; starqa/native/_rows.c: RMSNorm, RoPE, SiLU·mul; starqa/native/_layer.c: a decoder
layer's steps on either side of its attention; starqa/native/_step.c: every layer of a
forward), built by `pip install` where a C compiler is found and bound through ctypes by
starqa.native.kernels, whose mirrors of _kernels.h's structs carry each call's arguments.
Without them, `available()` is False and starqa.attention, starqa.topk and
starqa.models (linear, decoder) fall back to torch's and numpy's code."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from starqa.native import kernels
from starqa.native.kernels import int4_fast, int8_gemm_fast

_library = kernels.library


def _kernel():
    library = _library()
    return None if library is None else library.starqa_attend


def available() -> bool:
    """Whether the compiled kernel is here."""
    return _kernel() is not None


def _fits(x: torch.Tensor) -> bool:
    """[H, N, D] on the CPU, bf16 or fp32, rows contiguous, D at most 256."""
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
            and x.dim() == 3 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
            and x.shape[-1] <= 256)


def supports(key: torch.Tensor, value: torch.Tensor | None = None) -> bool:
    """Whether `attend` takes keys (and values) like these, [H, N, D]: CPU, bf16 or fp32,
    rows contiguous, D at most 256; values of the keys' shape and dtype."""
    return (_fits(key) and (value is None or _fits(value) and value.shape == key.shape
                            and value.dtype == key.dtype) and available())


def supports_int8(*rows: torch.Tensor) -> bool:
    """Whether `attend` takes int8 rows like these: pairs (data, scale), data int8 [H, N, D]
    on the CPU, rows contiguous, D at most 256, and scale fp32 [H, N] laid out as its rows
    (contiguous, heads a data head stride / D apart); every pair of one shape."""
    pairs = list(zip(rows[::2], rows[1::2]))
    return available() and all(
        data.device.type == "cpu" and data.dtype == torch.int8 and data.dim() == 3
        and data.stride(-1) == 1 and data.stride(-2) == data.shape[-1]
        and data.shape[-1] <= 256 and data.shape == pairs[0][0].shape
        and scale.dtype == torch.float32 and scale.shape == data.shape[:2]
        and scale.stride(-1) == 1 and scale.stride(0) * data.shape[-1] == data.stride(0)
        for data, scale in pairs)


def attend(q: torch.Tensor, parts: Sequence[tuple[torch.Tensor, ...]], scale: float,
           own: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel behind starqa.attention.partial_parts (see there): q [H, R, D] over the
    keys of `parts`, buffers (key, value) [H, N_i, D] as `supports` says (heads may lie any
    distance apart), one float dtype, or int8 rows (key, value, key scales, value scales)
    as `supports_int8` says, in order: as one buffer of their N = sum N_i keys, read
    where each lies. Returns out [H, R, D] and lse [H, R], both fp32."""
    if not parts or len(parts[-1]) > 2:  # the changing slot holds float keys only
        if own:
            raise ValueError(f"attention kernel: {own} own keys in int8 rows")
        return Layout(parts).attend(q, None, None, scale)
    return Layout(parts[:-1]).attend(q, *parts[-1], scale, own)


class Layout:
    """Buffers for `attend` laid out once (a shard's blocks, which never change), with a
    slot after them for one that changes at every call (the question's own KV): a
    `kernels.KeyTable` over the tensors. A part is (key, value), or int8 rows (key, value,
    key scales, value scales); `dtype` is the float parts' (None: none, any). biases: added
    to the score of every key of each part, in order (Phase 2's context bias; 0 past
    them), not to the changing buffer's."""

    def __init__(self, parts: Sequence[tuple[torch.Tensor, ...]],
                 biases: Sequence[float] = ()):
        self.parts = list(parts)  # (kept alive while the table points at them)
        self._table = kernels.KeyTable([_buffer(*part) for part in self.parts], biases=biases)
        self.keys = self._table.keys
        floats = [part[0].dtype for part in self.parts if len(part) == 2]
        self.dtype = floats[0] if floats else None

    def attend(self, q: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
               scale: float, own: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend` over the laid-out buffers, then (key, value) [H, M, D] if given (the
        buffer that changes; `own` of its keys are the queries' own)."""
        heads, rows, dim = q.shape
        q = q.to(torch.float32).contiguous()
        out = q.new_empty(heads, rows, dim)
        lse = q.new_empty(heads, rows)
        dtype = self.dtype if self.dtype is not None else key.dtype if key is not None else None
        code = self._table.attend(
            dtype == torch.bfloat16, kernels.starqa_queries(q.data_ptr(), heads, rows, dim),
            kernels.starqa_outputs(scale, out.data_ptr(), lse.data_ptr()),
            None if key is None else _buffer(key, value), own, torch.get_num_threads())
        if code:
            shapes = [tuple(part[0].shape) for part in self.parts] + \
                ([tuple(key.shape)] if key is not None else [])
            _check(code, f"attention kernel: impossible shapes q {tuple(q.shape)}, keys "
                         f"{shapes}, own {own}")
        return out, lse

    def attend_batch(self, q: torch.Tensor, owns: Sequence[tuple[torch.Tensor, torch.Tensor,
                                                                     int]],
                     rows: Sequence[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Several questions' rows of q [H, R, D], `rows[s]` of them each in order, over the
        laid-out buffers once, each then over its own (key, value) [H, N_s, D] (`owns[s]`,
        its last `own` keys its rows' own): each row, bit for bit, what `attend` gives it
        with its question's buffer alone."""
        heads, total, dim = q.shape
        q = q.to(torch.float32).contiguous()
        out, lse = q.new_empty(heads, total, dim), q.new_empty(heads, total)
        dtype = self.dtype if self.dtype is not None else owns[0][0].dtype
        code = self._table.attend_batch(
            dtype == torch.bfloat16, kernels.starqa_queries(q.data_ptr(), heads, total, dim),
            kernels.starqa_outputs(scale, out.data_ptr(), lse.data_ptr()),
            [(n, _buffer(key, value), own) for n, (key, value, own) in zip(rows, owns)],
            torch.get_num_threads())
        if code:
            _check(code, f"attention kernel: impossible shapes q {tuple(q.shape)}, rows "
                         f"{list(rows)}, own keys {[tuple(k.shape) for k, _, _ in owns]}")
        return out, lse

    def step_words(self) -> tuple[int, ...]:
        """The exact part of a layer's attention words for `decode_layers`
        (starqa_step_attention's `exact`): the address of the laid-out table, whose slot
        after its buffers the step fills with the own buffer at each call."""
        return (self._table.address,)


def _buffer(key: torch.Tensor, value: torch.Tensor, key_scale: torch.Tensor | None = None,
            value_scale: torch.Tensor | None = None) -> tuple[int, ...]:
    """(key, value) [H, N, D] (int8: with their scales [H, N]) as a `kernels.KeyTable`
    buffer."""
    return (key.data_ptr(), value.data_ptr(), key.shape[1], key.stride(0), value.stride(0),
            _address(key_scale) or 0, _address(value_scale) or 0)


def _address(x: torch.Tensor | None) -> int | None:
    """A tensor's address for a kernel's pointer argument; None (NULL) for none."""
    return None if x is None else x.data_ptr()


def supports_topk(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> bool:
    """Whether `TopKTable` takes these key and value buffers (see there); no values: a
    table that only selects (`TopKTable.select`)."""
    buffers = list(keys) + list(values)
    return (available() and all(_fits(x) for x in buffers)
            and len({x.dtype for x in keys}) == 1 and len({x.dtype for x in values}) <= 1
            and len({x.shape[-1] for x in buffers}) == 1)


DROP_KEYS = kernels.DROP_KEYS  # `TopKTable`'s drop


def _int64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _buffers(buffers: Sequence[tuple[int, torch.Tensor]] | None, n: int
             ) -> tuple[kernels.starqa_buffers, tuple]:
    """[(first row, [H, T, D])] as a `starqa_buffers` (none: an empty one), and the arrays
    it points into (the caller keeps them alive)."""
    if not buffers:
        return kernels.starqa_buffers(0, 0, None, None, None), ()
    arrays = (_int64([first for first, _ in buffers] + [n]),
              _int64([x.data_ptr() for _, x in buffers]),
              _int64([x.stride(0) for _, x in buffers]))
    return kernels.starqa_buffers(int(buffers[0][1].dtype == torch.bfloat16), len(buffers),
                                  *(x.data_ptr() for x in arrays)), arrays


def _key_order(key_map: torch.Tensor | None, key_at: torch.Tensor | None, n: int
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(key_map int64, key_at int32) as the kernel reads them, key_at the inverse
    permutation of key_map where not given (None, None: positions are rows)."""
    if key_map is None:
        return None, None
    key_map = key_map.to(torch.int64).contiguous()
    if key_at is None:
        key_at = torch.empty_like(key_map, dtype=torch.int32).scatter_(
            1, key_map, torch.arange(n, dtype=torch.int32).expand_as(key_map).contiguous())
    return key_map, key_at.to(torch.int32).contiguous()


def _lists(lists: tuple[torch.Tensor, torch.Tensor, int] | None,
           tail: tuple[torch.Tensor, torch.Tensor] | None, n: int
           ) -> tuple[kernels.starqa_lists, tuple]:
    """ivf's lists and tail (`TopKTable`) as a `starqa_lists` (None: flat, one list), and
    the tensors it points into."""
    if tail is not None and (lists is None or tail[0].shape != lists[0].shape
                             or tail[1].shape != (lists[0].shape[0], n)):
        raise ValueError(f"top-k kernel: a tail {tuple(tail[0].shape)} with row lists "
                         f"{tuple(tail[1].shape)} for {n} keys needs ivf's lists of that "
                         f"shape")
    if lists is None:
        return kernels.starqa_lists(1, None, None, 1, None, None), ()
    held = (lists[0].to(torch.bfloat16).contiguous(), lists[1].to(torch.int64).contiguous(),
            None if tail is None else tail[0].to(torch.bfloat16).contiguous(),
            None if tail is None else tail[1].to(torch.int32).contiguous())
    centroids, offsets, tail_values, tail_lists = map(_address, held)
    return kernels.starqa_lists(held[0].shape[1], centroids, offsets, lists[2], tail_values,
                                tail_lists), held


class TopKTable:
    """The top-k kernel's `starqa_topk_table` (starqa/native/_kernels.h: what stays the
    same from call to call), laid out once: a layer's key and value buffers, its key order
    and ivf's lists. Built per call they cost ~15 small tensor operations a layer
    (SmolLM2's ivf decode at 32K: ~27.8 against 25.6 ms/token); a top-k shard keeps one
    table per layer (starqa.topk).

    keys: [(first position, [H, T, D])] the buffers holding positions 0 .. N-1 of every head,
    in order; key_map [H, N] int64: each position's row in the shard, key_at [H, N] int32
    each row's position (both None: the same). values: [(first row, [H, T, D])] the buffers
    holding the shard's value rows, or None: a table that only selects (`select`; the
    values are elsewhere, e.g. on a GPU). lists (ivf): (centroids [H, C, D], read in bf16,
    offsets [H, C + 1] int64, probes): position ranges, and how many of the nearest a row
    scans; None scans every position. drop: DROP_KEYS where the key buffers are clean private
    file mappings (flat's --kv-on-disk): the kernel drops their pages as its scan passes
    them (starqa/native/_topk_lists.c), so a layer's keys are never resident at once; the
    same results. tail (ivf): (each list's mean value [H, C, D], read in bf16; each shard
    row's list [H, N] int32): the keys a row's union leaves out enter its softmax as their
    lists' estimate (`topk.tail_part`; starqa/native/_topk_tail.c); None: they weigh
    nothing (top-k alone). The buffers must stay where they are while the table lives (it
    keeps them referenced)."""

    def __init__(self, keys: Sequence[tuple[int, torch.Tensor]],
                 values: Sequence[tuple[int, torch.Tensor]] | None,
                 key_map: torch.Tensor | None = None,
                 lists: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                 key_at: torch.Tensor | None = None, drop: int = 0,
                 tail: tuple[torch.Tensor, torch.Tensor] | None = None):
        n = keys[-1][0] + keys[-1][1].shape[1]
        self.drop = drop
        key_map, key_at = _key_order(key_map, key_at, n)
        key_buffers, key_arrays = _buffers(keys, n)
        value_buffers, value_arrays = _buffers(values, n)
        list_struct, list_tensors = _lists(lists, tail, n)
        self.lists, self.probes = list_struct.count, list_struct.probes
        self.selects_only = not values
        # what the kernel reads through the table's addresses, kept alive with it
        self._keep = (keys, values, key_map, key_at, key_arrays, value_arrays, list_tensors)
        self.table = kernels.starqa_topk_table(n, key_buffers, _address(key_map),
                                               _address(key_at), value_buffers, list_struct,
                                               drop)
        self._pointer = ctypes.pointer(self.table)

    def step_words(self, k: int, skip: int, release: torch.Tensor | None = None,
                   bias: float = 0.0, unbiased: int = 0) -> tuple:
        """The top-k part of a layer's attention words for `decode_layers`
        (starqa_step_attention's topk, k, skip, release, releases, bias and unbiased): the
        table's address, k, skip, then `release` [P, 2] int64 (the caller keeps it alive):
        the (address, length) of the memory-mapped pages that the step releases after the
        layer's attention; then `attend`'s bias and unbiased."""
        if self.selects_only:
            raise ValueError("top-k kernel: this table holds no values (it only selects)")
        if release is not None and (release.dtype != torch.int64 or release.dim() != 2
                                    or release.shape[1] != 2 or not release.is_contiguous()):
            raise ValueError(f"top-k kernel: release ranges {tuple(release.shape)} "
                             f"{release.dtype} (int64 [P, 2], contiguous)")
        pairs = (0, 0) if release is None else (release.data_ptr(), release.shape[0])
        return (ctypes.addressof(self.table), k, skip, *pairs, bias, unbiased)

    def attend(self, q: torch.Tensor, k: int, skip: int, scale: float,
               tokens: int | None = None,
               own: tuple[torch.Tensor, torch.Tensor] | None = None, bias: float = 0.0,
               unbiased: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k partial attention of every row of q [H, R, D] (starqa/native/_topk.h says
        how). tokens: the forward's positions M, the rows being G blocks of M
        (`attention.fold_gqa`); the G rows of a position share their keys (None: M = R,
        nothing shared). Rows below `skip` (the sink) are never picked, and every row
        attends to them. own: the query host's own (keys, values) [H, L, D] (rows
        contiguous, bf16 or fp32), the last M of them this forward's, attended causally
        with the rest under one softmax. bias: added to every shard key's score (the
        sink's, the picks', the tail's; Phase 2's context bias) but the shard rows below
        `unbiased` (the keys the context holds once), never to the own keys'; the picks do
        not depend on it. Returns out [H, R, D] and lse [H, R], fp32 (a row with
        no key: 0 and -inf)."""
        if self.selects_only:
            raise ValueError("top-k kernel: this table holds no values (it only selects)")
        heads, rows, dim = q.shape
        tokens = rows if tokens is None else tokens
        q = q.to(torch.float32).contiguous()
        out, lse = q.new_empty(heads, rows, dim), q.new_empty(heads, rows)
        code = _library().starqa_topk_attend(kernels.starqa_topk_args(
            self._pointer, kernels.starqa_queries(q.data_ptr(), heads, rows, dim), tokens, k,
            skip, bias, unbiased, _own_keys(own, q, tokens),
            kernels.starqa_outputs(scale, out.data_ptr(), lse.data_ptr()),
            torch.get_num_threads()))
        if code:
            _check(code, f"top-k kernel: impossible arguments q {tuple(q.shape)}, "
                                      f"k {k}, {self.lists} lists, {self.probes} probes")
        return out, lse

    def select(self, q: torch.Tensor, k: int, skip: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's k best keys, as `attend` picks them, without attending: q [H, R, D]
        (any device; ranked on the CPU, where the keys are) → scores fp32 and shard rows
        int64 [H, R, k], in no set order: raw inner products q . key, -inf and -1 past the
        keys found. Rows below `skip` (the sink) are never picked. Each row is on its own
        (the GQA union is the caller's, `topk.share`)."""
        heads, rows, dim = q.shape
        q = q.to("cpu", torch.float32).contiguous()
        found = torch.empty(heads, rows, k, dtype=torch.int64)
        scores = torch.empty(heads, rows, k)
        code = _library().starqa_topk_select(kernels.starqa_select_args(
            self._pointer, kernels.starqa_queries(q.data_ptr(), heads, rows, dim), k, skip,
            found.data_ptr(), scores.data_ptr(), torch.get_num_threads()))
        if code:
            _check(code, f"top-k kernel: impossible arguments q {tuple(q.shape)}, "
                                      f"k {k}, {self.lists} lists, {self.probes} probes")
        return scores, found


def _own_keys(own: tuple[torch.Tensor, torch.Tensor] | None, q: torch.Tensor, tokens: int
              ) -> kernels.starqa_own_keys:
    """`TopKTable.attend`'s own keys and values (see there) as the kernel reads them, checked
    against q [H, R, D] (None: none)."""
    if own is None:
        return kernels.starqa_own_keys(0, None, None, 0, 0)
    heads, _, dim = q.shape
    own_k, own_v = own
    if not (own_k.dtype == own_v.dtype and own_k.dtype in (torch.bfloat16, torch.float32)
            and own_k.shape == own_v.shape and own_k.shape[0] == heads
            and own_k.stride() == own_v.stride() and own_k.stride()[1:] == (dim, 1)
            and own_k.shape[1] >= tokens and own_k.device.type == "cpu"):
        raise ValueError(f"top-k kernel: own keys {tuple(own_k.shape)} {own_k.dtype} "
                         f"strides {own_k.stride()} for q {tuple(q.shape)}")
    return kernels.starqa_own_keys(int(own_k.dtype == torch.bfloat16), own_k.data_ptr(),
                                   own_v.data_ptr(), own_k.stride(0), own_k.shape[1] - tokens)


def int4_mm(x: torch.Tensor, tiles: torch.Tensor, fast: bool = True) -> torch.Tensor:
    """x [M, K] (bf16 or fp32, CPU) times int4 weights [N, K] packed as `tiles` (uint8
    [N / 16, K / 32, 320], starqa/native/_int4.c says how) transposed: [M, N] in x's dtype,
    the activations quantised to 14 bits per group of 32. fast=False: the kernel's plain C
    path (the same sums; for tests)."""
    library = _library()
    n, k = tiles.shape[0] * 16, tiles.shape[1] * 32
    if (x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu"
            or x.dim() != 2 or x.shape[-1] != k):
        raise ValueError(f"int4 kernel: x {tuple(x.shape)} {x.dtype} against weights [{n}, {k}]")
    x = x.contiguous()
    y = x.new_empty(x.shape[0], n)
    bf16 = int(x.dtype == torch.bfloat16)
    _check(library.starqa_int4_mm(kernels.starqa_int4_args(
        bf16, x.data_ptr(), x.shape[0], k, tiles.data_ptr(), n, bf16, y.data_ptr(), int(fast),
        torch.get_num_threads())), f"int4 kernel: shapes {n}x{k}")
    return y


def rows_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `rms_norm` and `rope_` take tensors of this device and dtype."""
    return available() and device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [M, H] with `weight` [H] (starqa/native/_rows.c: transformers' roundings), both
    contiguous, of one dtype that `rows_supported` takes (the caller's to check: this runs
    once per norm of every token, and is kept lean: ~4 µs against torch's ~11)."""
    y = torch.empty_like(x)
    _library().starqa_rms_norm(x.dtype == torch.bfloat16, x.data_ptr(), x.shape[0], x.shape[1],
                               weight.data_ptr(), eps, y.data_ptr())
    return y


def rope_(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in place on heads [0, heads) of x [M, H, D] with cos, sin [M, 1, D]
    (starqa/native/_rows.c), all contiguous, of one dtype that `rows_supported` takes, D even and
    at most 512; returns x[:, :heads]."""
    if _library().starqa_rope(x.dtype == torch.bfloat16, x.data_ptr(), x.shape[0],
                              x.shape[1] * x.shape[2], heads, x.shape[2], cos.data_ptr(),
                              sin.data_ptr()):
        raise ValueError(f"RoPE kernel: head size {x.shape[2]} (even, at most 512)")
    return x[:, :heads]


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
               attention: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [M, 1, D] in `dtype` (one `rows_supported` takes) for `positions` [M] and
    fp32 `inv_freq` [D / 2] (starqa/native/_rows.c: angles in fp32, libm's cos and sin),
    times the RoPE's `attention` factor in fp32 before the rounding (starqa.models.rope)."""
    positions = positions.to(torch.int64).contiguous()
    inv_freq = inv_freq.to(torch.float32).contiguous()
    m, d = positions.shape[0], 2 * inv_freq.shape[0]
    cos, sin = (torch.empty(m, 1, d, dtype=dtype) for _ in range(2))
    _library().starqa_rope_table(dtype == torch.bfloat16, positions.data_ptr(), m,
                                 inv_freq.data_ptr(), d, attention, cos.data_ptr(),
                                 sin.data_ptr())
    return cos, sin


def _check(code: int, what: str) -> None:
    """Raise for a kernel's code: 1 impossible arguments (ValueError, `what`), 2 out of
    memory."""
    if code:
        raise MemoryError() if code == 2 else ValueError(what)


def _linear(weights: tuple[torch.Tensor, torch.Tensor | None]) -> kernels.starqa_linear:
    """(int4 tiles, bias or None) as a `starqa_linear`."""
    return kernels.starqa_linear(weights[0].data_ptr(), _address(weights[1]))


def layer_before(hidden: torch.Tensor, norm: torch.Tensor, eps: float,
                 qkv: tuple[torch.Tensor, torch.Tensor | None], rotated: int, dim: int,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A decoder layer before its attention (starqa/native/_layer.c): RMSNorm of hidden
    [M, H], times qkv (int4 tiles, bias or None), RoPE on the first `rotated` heads of
    D = dim; returns [M, N / dim, dim]. Every tensor contiguous, one dtype
    `rows_supported` takes (the caller's to check, as for `rms_norm`)."""
    m, h = hidden.shape
    tiles = qkv[0]
    n = tiles.shape[0] * 16
    if tiles.shape[1] * 32 != h or n % dim:
        raise ValueError(f"decoder layer: hidden {tuple(hidden.shape)} against qkv tiles "
                         f"{tuple(tiles.shape)} of heads of {dim}")
    y = hidden.new_empty(m, n // dim, dim)
    _check(_library().starqa_layer_before(kernels.starqa_before_args(
        hidden.dtype == torch.bfloat16, hidden.data_ptr(), m, h, norm.data_ptr(), eps,
        _linear(qkv), n, rotated, dim, cos.data_ptr(), sin.data_ptr(), y.data_ptr(),
        torch.get_num_threads())), "decoder layer: impossible shapes")
    return y


def layer_after(hidden: torch.Tensor, attn: torch.Tensor, out, norm: torch.Tensor, eps: float,
                gate_up, down) -> None:
    """A decoder layer after its attention (starqa/native/_layer.c), on hidden [M, H] in
    place: the output projection of attn [M, K] and its residual, RMSNorm, the MLP and its
    residual. out, gate_up, down: (int4 tiles, bias or None). Every tensor contiguous,
    one dtype `rows_supported` takes."""
    m, h = hidden.shape
    if (attn.shape[1] != out[0].shape[1] * 32 or out[0].shape[0] * 16 != h
            or gate_up[0].shape[1] * 32 != h or down[0].shape[0] * 16 != h
            or down[0].shape[1] * 32 != gate_up[0].shape[0] * 8):
        raise ValueError(f"decoder layer: hidden {tuple(hidden.shape)}, attention "
                         f"{tuple(attn.shape)} against tiles {tuple(out[0].shape)}, "
                         f"{tuple(gate_up[0].shape)}, {tuple(down[0].shape)}")
    _check(_library().starqa_layer_after(kernels.starqa_after_args(
        hidden.dtype == torch.bfloat16, hidden.data_ptr(), m, h, attn.data_ptr(),
        attn.shape[1], _linear(out), norm.data_ptr(), eps, _linear(gate_up),
        gate_up[0].shape[0] * 8, _linear(down), torch.get_num_threads())),
        "decoder layer: impossible shapes")


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(g) · u for x [M, 2N] = [g ‖ u], contiguous, of a dtype `rows_supported` takes
    (starqa/native/_rows.c: torch's roundings, one exp of starqa's): [M, N]."""
    m, n = x.shape[0], x.shape[1] // 2
    y = x.new_empty(m, n)
    _library().starqa_silu_mul(x.dtype == torch.bfloat16, x.data_ptr(), m, n, y.data_ptr())
    return y


# A layer's values for `step_words`, in the order of starqa/native/_kernels.h's structs:
# the model's (starqa_step_model's fields), the attention's (starqa_step_attention's kind,
# scale, own keys, own values, their capacity, then exact's table or top-k's, k, skip,
# release pages and bias: what `Layout.step_words` and `TopKTable.step_words` give).
MODEL_WORDS = tuple(name for name, _ in kernels.starqa_step_model._fields_)
STEP_EXACT, STEP_TOPK = kernels.STEP_EXACT, kernels.STEP_TOPK
_ATTENTION_WORDS = {
    STEP_EXACT: ("kind", "scale", "own_k", "own_v", "capacity", "exact"),
    STEP_TOPK: ("kind", "scale", "own_k", "own_v", "capacity", "topk", "k", "skip", "release",
                "releases", "bias", "unbiased"),
}


def _fill(struct: ctypes.Structure, names: Sequence[str], values: Sequence) -> None:
    """Set `struct`'s fields `names` to `values`: a tensor by its address, a pointer to a
    struct from an address, anything else as it is (None: NULL)."""
    if len(names) != len(values):
        raise ValueError(f"decode step: {len(values)} values for the fields {names}")
    kinds = dict(struct._fields_)
    for name, value in zip(names, values):
        if isinstance(value, torch.Tensor):
            value = value.data_ptr()
        elif issubclass(kinds[name], ctypes._Pointer):  # a POINTER(struct), from an address
            value = ctypes.cast(value, kinds[name])
        setattr(struct, name, value)


def step_words(layers: Sequence[Sequence], attention: bool = False) -> torch.Tensor | None:
    """The structs `decode_layers` reads, one per layer, laid out in an int64 tensor [L,
    words]: starqa_step_model from each layer's values in MODEL_WORDS order, or with
    attention, starqa_step_attention from (kind, scale, own keys, own values, capacity,
    *the kind's table words); None where the compiled library is not here."""
    if _library() is None:
        return None
    struct = kernels.starqa_step_attention if attention else kernels.starqa_step_model
    size = ctypes.sizeof(struct)  # a multiple of 8: the structs hold int64s
    words = torch.zeros(len(layers), size // 8, dtype=torch.int64)
    for index, values in enumerate(layers):
        names = _ATTENTION_WORDS[values[0]] if attention else MODEL_WORDS
        _fill(struct.from_address(words.data_ptr() + index * size), names, values)
    return words


def decode_layers(model: torch.Tensor, attention: torch.Tensor, hidden: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, before: int, q_rows: torch.Tensor,
                  lse: torch.Tensor) -> None:
    """Every decoder layer of a forward in one call (starqa/native/_step.c), on hidden [M, H]
    in place: model and attention, `step_words`' structs (their tensors alive and where
    they were); cos, sin [M, 1, D] (`rope_table`); before: the own keys written before this
    forward's; q_rows [L, Hkv, G * M, D] and lse [L, Hkv, G * M], fp32, contiguous: filled
    with each layer's folded query rows and their LSE."""
    layers, m = model.shape[0], hidden.shape[0]
    if (attention.shape[0] != layers or not hidden.is_contiguous() or q_rows.shape[0] != layers
            or q_rows.dtype != torch.float32 or lse.dtype != torch.float32
            or not q_rows.is_contiguous() or not lse.is_contiguous()):
        raise ValueError(f"decode step: {layers} layers against attention words "
                         f"{tuple(attention.shape)}, rows {tuple(q_rows.shape)}")
    step = kernels.starqa_decode_args(
        layers, ctypes.cast(model.data_ptr(), ctypes.POINTER(kernels.starqa_step_model)),
        ctypes.cast(attention.data_ptr(), ctypes.POINTER(kernels.starqa_step_attention)),
        hidden.data_ptr(), m, cos.data_ptr(), sin.data_ptr(), before, q_rows.data_ptr(),
        lse.data_ptr(), torch.get_num_threads())
    _check(_library().starqa_decode_layers(step), "decode step: impossible shapes")
