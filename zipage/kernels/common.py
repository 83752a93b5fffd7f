"""Small helpers shared by the kernel wrappers.

Triton compiles a kernel once per specialization of its integer arguments (an argument equal
to 1, or divisible by 16, gets its own binary). Arguments that change from step to step (the
width of a batch's block table, a compression batch's longest length, a split count) are
listed in the kernel's ``do_not_specialize``: otherwise a server meets a new combination now
and then and stalls for a compile (a second or more) in the middle of serving.
"""

import functools
import logging

import torch

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton for this platform: only the PyTorch twins are usable
    triton = None
gdc_wait = gdc_launch_dependents = None  # Triton's grid dependency control, where it has it


def dot_precision(dtype: torch.dtype) -> str:
    """Matrix-unit precision for ``tl.dot``: exact IEEE products for float32 inputs
    (TF32 would cost ~1e-3 relative error), the native path for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


# -- FP8 KV cache (docs/fp8.md, "KV cache") ----------------------------------------
# Keys and values stored as float8 e4m3 (torch.float8_e4m3fn, Triton's float8e4nv) with a
# float32 scale per token and KV head: scale = amax over head_dim / FP8_MAX, so that the
# largest element of every row maps to +-448; a row of zeros (or of values below
# FP8_AMAX_FLOOR) gets the floor instead of 0 and stores zeros (or its tiny values).
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-8


def is_fp8(dtype: torch.dtype) -> bool:
    return FP8_DTYPE is not None and dtype == FP8_DTYPE


def token_major(v_cache: torch.Tensor) -> bool:
    """Whether a [blocks, block_size, kv_heads, head_dim] value cache is stored token-major (slots
    contiguous, as a float8 cache stores its values; a block of one slot reads either way)."""
    return v_cache.stride(1) == 1 and v_cache.shape[1] > 1


def fp8_scales_torch(x: torch.Tensor) -> torch.Tensor:
    """Dynamic scale of every row ``x[..., :]`` (float32, the shape of x without its last dimension)."""
    return x.float().abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR) / FP8_MAX


def quantize_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale rounded to float8 e4m3 (to nearest, ties to even), scale) per row of ``x``."""
    scale = fp8_scales_torch(x)
    q = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8_torch(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q`` (float8 rows) times their ``scale`` (the shape of q without its last dimension)."""
    return (q.to(torch.float32) * scale[..., None].float()).to(dtype)


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device, for sizing grids; 1 elsewhere (the Triton CPU interpreter runs
    programs one at a time)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def fast_fp8_widening(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether kernels widen float8 to ``dtype`` with ``fp8_to_bf16`` (bf16 on a GPU; the
    Triton interpreter has no inline assembly, and other dtypes take Triton's conversion)."""
    return FAST_FP8_WIDENING and dtype == torch.bfloat16 and device.type == "cuda"


FAST_FP8_WIDENING = True  # False: Triton's own conversion everywhere (for comparisons)


# -- Programmatic dependent launch ----------------------------------------------------
# A decode step is a chain of a dozen short kernels a layer, and the device idles between
# two of them while the next one's programs are launched (3-5% of an fp8 step on an H200,
# docs/fp8.md). With PDL on (Hopper and newer), the kernels of that chain launch with the
# programmatic-serialization attribute: the next kernel's programs are scheduled while the
# last wave of the one before runs, each waits (``griddepcontrol.wait``) until that kernel
# has finished and its writes are visible, and only then touches memory. On an H200 it made
# fp8 decode steps 0-2% faster and reasoning-8k 0.9% (docs/fp8.md; scripts/gpu_fp8.sh pdl).
PDL = True
# When the next kernel's programs may start launching: True, as soon as every program of this
# kernel has started and waited (they then hold SM resources while this one runs); False, as
# this kernel's programs exit (only the launch and the prologue overlap its last programs).
# Launched early, steps at 64-256 requests ran from 3% slower to 2% faster across two starts
# of an H200; launched at exit, 0-2% faster.
PDL_EARLY_TRIGGER = False


@functools.lru_cache(maxsize=None)
def device_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (major, minor), asked once per device."""
    return torch.cuda.get_device_capability(device)


def pdl_launch(device: torch.device) -> dict:
    """Extra arguments of a launch of a step kernel on ``device``: ``PDL`` (the kernel's
    constexpr that makes it wait for the kernel before it: 1 to let the next kernel launch
    early, 2 not, see ``PDL_EARLY_TRIGGER``) and ``launch_pdl`` (Triton's launch option) when
    PDL is on and the device has it; nothing else, so that the CPU interpreter never sees them."""
    if not PDL:  # first: this runs at every launch of a step kernel
        return {}
    device = torch.device(device)
    if gdc_wait is None or device.type != "cuda" or device_capability(device)[0] < 9:
        return {}
    return {"PDL": 1 if PDL_EARLY_TRIGGER else 2, "launch_pdl": True}


def split_pdl(extra: dict) -> tuple[dict, dict]:
    """``pdl_launch``'s arguments as (constexprs, launch options), for ``launch_kernel``."""
    return {"PDL": extra.get("PDL", False)}, {k: v for k, v in extra.items() if k == "launch_pdl"}


# Whether StepLaunches may launch binaries directly; turned off, with a warning, the first time a
# direct launch fails (a Triton whose compiled kernels take their arguments otherwise).
_DIRECT_LAUNCH = {"usable": True}


class StepLaunches:
    """The Triton kernels of one step that runs attention eagerly, layer after layer.

    Every layer launches the same kernels with arguments of the same shapes, dtypes and
    alignment: only the layer's caches differ, equal slices of one tensor. The first launch of
    each kernel goes through Triton's dispatch, which binds the arguments, works out their
    specialization and finds (or compiles) the binary for it; the following layers launch that
    binary directly. The dispatch is tens of microseconds of Python a launch, which a step of
    prompt chunks beside decodes pays for several kernels a layer while the device waits for
    the host (``docs/benchmarks.md``, "Long prompts among decoding streams").

    The callers pass one object per step (``AttentionMetadata.launches``) to ``launch_kernel``.
    Scratch buffers the layers use one after the other (stream order) are kept here too, so that
    a step allocates them once.
    """

    def __init__(self):
        self._binaries: dict = {}
        self._scratch: dict = {}
        self.direct = 0  # launches that skipped the dispatch

    def launch(self, kernel, grid, args: tuple, constexprs: dict, **options) -> None:
        """``kernel[grid](*args, **constexprs, **options)``, with ``args`` positional in the kernel's
        order and ``constexprs`` its remaining parameters, by name. A binary is kept per kernel, grid,
        constants and options, and launched directly only for arguments of the specialization it
        was found for (each tensor's dtype and 16-byte alignment, each integer's being 1, a multiple
        of 16 or wider than 32 bits, as Triton specializes them)."""
        key = (kernel, tuple(grid), *constexprs.values(), *options.items())
        known = self._binaries.get(key)
        if known is not None and _DIRECT_LAUNCH["usable"]:
            binary, specialization = known
            if binary is not None and _specialization(args) == specialization:
                try:
                    grid = tuple(grid) + (1,) * (3 - len(grid))
                    binary[grid](*args, *(constexprs[name] for name in kernel.arg_names[len(args):]))
                    self.direct += 1
                    return
                except (AttributeError, KeyError, TypeError, ValueError) as error:
                    _DIRECT_LAUNCH["usable"] = False
                    logger.warning("launching a compiled Triton kernel directly failed (%s); kernels now go "
                                   "through Triton's dispatch every time", error)
        # The dispatch returns the binary it launched (nothing in the CPU interpreter). A binary's own
        # launch calls Triton's launch hooks as the dispatch does.
        self._binaries[key] = (kernel[grid](*args, **constexprs, **options), _specialization(args))

    def scratch(self, key, make):
        """The step's buffer under ``key``, made by ``make()`` at its first use."""
        buffer = self._scratch.get(key)
        if buffer is None:
            buffer = self._scratch[key] = make()
        return buffer


def launch_kernel(kernel, grid, args: tuple, constexprs: dict, launches: StepLaunches | None = None,
                  **options) -> None:
    """``kernel[grid](*args, **constexprs, **options)``, through the step's ``launches`` when given."""
    if launches is None:
        kernel[grid](*args, **constexprs, **options)
    else:
        launches.launch(kernel, grid, args, constexprs, **options)


def _specialization(args: tuple) -> tuple:
    """What Triton's binaries depend on in the positional arguments of a launch (besides constants)."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                 else (a == 1, a % 16 == 0, -2**31 <= a < 2**31) if isinstance(a, int) else type(a) for a in args)


if triton is not None:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # a Triton without grid dependency control: they stay None, and PDL off (pdl_launch)
        pass

    @triton.jit
    def wait_for_previous_kernel(PDL: tl.constexpr):
        """First thing in a step kernel, before it touches memory: with programmatic dependent
        launch (PDL), wait until the kernel before it in the stream has finished and its writes
        are visible; with PDL == 1, then let the next kernel's programs start launching (with
        PDL == 2 they do as this kernel's programs exit)."""
        if PDL:
            gdc_wait()
            if PDL == 1:
                gdc_launch_dependents()

    @triton.jit
    def fp8_to_bf16(x):
        """e4m3 -> bf16 with integer ops, four bytes at a time. Each byte ``s eeee mmm`` is
        permuted into the low byte of a 16-bit lane, the lane's high byte filled with copies
        of its sign (prmt's sign-replicating selectors 0x8-0xb); shifted left by 4, the lane
        holds the sign bits above ``eeee mmm`` at bits 10..4; a mask keeps bit 15 (the sign)
        and bits 10..4 (and drops what the shift pushed into the next lane). Those bits, read
        as bf16, are the e4m3 value times 2**-120 (subnormals too): a bf16x2 multiply by 2**120
        (0x7B80) makes it exact. Three integer ops and a half multiply per two elements, where
        Triton's own conversion (through fp16) takes a quarter-rate conversion instruction per
        element. NaN (0x7f) is not kept: weights and cached keys and values are finite."""
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 lo, hi, two120;
            mov.b32 two120, 0x7B807B80;
            prmt.b32 lo, $2, 0, 0x9180;
            prmt.b32 hi, $2, 0, 0xB3A2;
            shl.b32 lo, lo, 4;
            shl.b32 hi, hi, 4;
            and.b32 lo, lo, 0x87F087F0;
            and.b32 hi, hi, 0x87F087F0;
            mul.rn.bf16x2 $0, lo, two120;
            mul.rn.bf16x2 $1, hi, two120;
            }
            """,
            constraints="=r,=r,r",
            args=[x.to(tl.uint8, bitcast=True)],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )

    @triton.jit
    def widen_fp8(x, dtype: tl.constexpr, FAST: tl.constexpr):
        """float8 ``x`` as ``dtype`` (exact): ``fp8_to_bf16`` when FAST (see fast_fp8_widening)."""
        if FAST:
            return fp8_to_bf16(x)
        else:
            return x.to(dtype)

    @triton.jit
    def round_to_e4m3(v):
        """``v`` (float32, |v| <= 448) rounded to the nearest e4m3 value (ties to even), still
        in float32, so that the cast after it is exact (the Triton interpreter's own float8
        rounding is crude: it mis-rounds where rounding carries into the exponent). Adding then
        subtracting ``1.5 * 2**23 * q`` rounds to a multiple of q, the spacing of e4m3 values
        around ``v``: 2**(exponent - 3), and 2**-9 below 2**-6."""
        exponent = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
        q_exponent = tl.maximum(exponent, 127 - 6) - 3
        magic = ((q_exponent + 23) << 23).to(tl.float32, bitcast=True) * 1.5
        return (v + magic) - magic

    @triton.jit
    def load_kv_scales(k_scale_ptr, v_scale_ptr, pages, positions, stride_block, stride_slot, kv_head, mask,
                       PAGE_SIZE: tl.constexpr):
        """The float32 scales of the keys and values at ``positions`` (held in ``pages``) of one KV
        head of a float8 cache; 0 where ``mask`` is off."""
        offsets = pages.to(tl.int64) * stride_block + (positions % PAGE_SIZE) * stride_slot + kv_head
        return (tl.load(k_scale_ptr + offsets, mask=mask, other=0.0),
                tl.load(v_scale_ptr + offsets, mask=mask, other=0.0))

else:
    fp8_to_bf16 = widen_fp8 = load_kv_scales = round_to_e4m3 = wait_for_previous_kernel = None
