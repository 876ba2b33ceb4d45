"""Argument checks: one rule per kind of value, the same at every public entry point.

A public entry (a constructor or function a user calls: LLMEngine, generate, PagedKVCache,
KVCacheManager, BlockPool, ModelConfig, SamplingParams, ...) checks each argument once, with the
function here for its kind, before it changes or allocates anything. What it builds inside, it
hands the frozen options object its checks made (cache/options.py's ManagerOptions,
cache/cache_options.py's CacheOptions), and the inner constructor trusts it: the engine checks
block_size, and the cache and the manager it builds do not check it again. docs/design.md ("Validation") tables
which function checks what, and where.

An integer is a Python int or a numpy integer (numbers.Integral), never a bool (True is not 1) and
never a float (2.0 is not rounded); a flag is True or False; a name is one of a fixed set. A
refused value gets one ValueError, in one of two forms:

    num_blocks=2.5 is a float; allowed: an integer in [1, 2**31 - 1]        the wrong kind of value
    num_blocks=0 is not allowed; allowed: an integer in [1, 2**31 - 1]      the right kind, out of range

with the value's repr cut short: a message quotes a value, it does not print it whole. Every size an
argument can ask for has a stated bound, checked before anything is allocated.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import reprlib

import numpy as np
import torch

MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1  # ids held in int64 tensors (sequence ids)
MAX_BLOCKS = MAX_INT32  # block tables are int32, and their padding entry is the pool's size
MAX_BLOCK_SIZE = 256  # the largest block the memory benchmark sweeps and notebook 03 offers
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes up to 2**64 - 1; the engine's bound
IDS_ALLOWED = "integer ids (an integer tensor or array, a list of ints, or one int)"
# `bench serving` serves every request through the model on this machine, once per design (three, five
# with --budget), at a few hundred tokens a second: 4,096 requests of its default lengths take about an
# hour. Beyond that the benchmark measures nothing more; it only runs for days.
MAX_SERVING_REQUESTS = 4096
# The cluster simulator's routing traces keep every token's experts (int16, layers x top-k: 96 bytes a
# token for JetMoE's 24 layers, top-2) plus what building them takes: about 0.2 MB a request of the
# published lengths (1,400 tokens on average, measured), so 10^5 requests fill some 20 GB and take half
# an hour to build. bench simulator --scale's compact trace keeps one int32 a token: 10^6 requests of
# its 768 tokens, 3 GB.
MAX_TRACE_REQUESTS = 100_000
MAX_COMPACT_TRACE_REQUESTS = 1_000_000

_SHORT = reprlib.Repr()  # a refused value as a message quotes it: bounded, however large or deep
_SHORT.maxlevel = 3
_SHORT.maxstring = 60
_SHORT.maxother = 60
_SHORT.maxlong = 40
_SHORT.maxlist = 6
_SHORT.maxtuple = 6
_SHORT.maxdict = 6
_SHORT.maxset = 6


def shown(value) -> str:
    """repr(value) cut short, at a cost bounded however large or deeply nested the value is."""
    if isinstance(value, numbers.Integral) and abs(int(value)).bit_length() > 128:
        return f"<an integer of {abs(int(value)).bit_length()} bits>"  # repr refuses past 4300 digits
    if type(value).__repr__ is object.__repr__:  # <module.Class object at 0x...>: the class says it
        return f"<{type(value).__name__} object>"
    return _SHORT.repr(value)


def a_type(value) -> str:
    """ "an int", "a float", "a str": the type of a refused value, for an error message."""
    name = type(value).__name__
    return ("an " if name[0] in "aeiou" else "a ") + name


def number(n) -> str:
    """A bound as a message states it: 2**31 - 1 rather than 2147483647 (a power of two from 2**20
    on, less at most 1023)."""
    for power in range(20, 65):
        below = 2**power - n
        if 0 <= below < 1024:
            return f"2**{power}" + (f" - {below}" if below else "")
    return str(n)


def is_integer(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(
    name: str, value, minimum: int, maximum: int | None = None, meaning: str = "", allow_none: bool = False
) -> int | None:
    """An integer in [minimum, maximum] (no maximum: >= minimum), as a Python int; None passes
    where allow_none. `meaning` says what the number is, or what a special value means."""
    if value is None and allow_none:
        return None
    if is_integer(value) and minimum <= value and (maximum is None or value <= maximum):
        return int(value)
    # refused: the message is built only now (the simulator checks every request's counts)
    bound = f">= {number(minimum)}" if maximum is None else f"in [{number(minimum)}, {number(maximum)}]"
    allowed = (
        f"an integer {bound}" + (f" ({meaning})" if meaning else "") + (", or None" if allow_none else "")
    )
    if not is_integer(value):
        raise ValueError(f"{name}={shown(value)} is {a_type(value)}; allowed: {allowed}")
    raise ValueError(f"{name}={shown(value)} is not allowed; allowed: {allowed}")


def check_real(
    name: str,
    value,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    meaning: str = "",
    allow_none: bool = False,
) -> float | int | None:
    """A finite real number (an int or a float, not a bool) from low to high, each end closed unless
    *_open; returned as given (an int stays an int)."""
    left = "(" if low_open else "["
    right = ")" if high_open or high == math.inf else "]"
    interval = f"{left}{low:g}, {'inf' if high == math.inf else format(high, 'g')}{right}"
    allowed = f"a finite number in {interval}" + (f" ({meaning})" if meaning else "")
    allowed += ", or None" if allow_none else ""
    if value is None and allow_none:
        return None
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"{name}={shown(value)} is {a_type(value)}; allowed: {allowed}")
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (math.isfinite(value) and above and below):
        raise ValueError(f"{name}={shown(value)} is not allowed; allowed: {allowed}")
    return value


MAX_TIMEOUT_S = 86400.0  # a day: beyond it a timeout is no longer a limit (and timedelta overflows)


def is_seconds(value) -> bool:
    """Whether value is a timeout: a finite real number (not a bool) > 0 and at most a day."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S


def check_seconds(name: str, value) -> float:
    """A timeout in seconds (is_seconds), as a float."""
    if not is_seconds(value):
        raise ValueError(f"{name}={value!r} must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:.0f}")
    return float(value)


def check_flag(name: str, value) -> bool:
    """A flag is True or False, never a truthy string or 1."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={shown(value)} is {a_type(value)}; allowed: True or False")
    return value


def check_choice(name: str, value, allowed, also: str = "") -> str:
    """One of the names `allowed` (a str; `also` names what else the caller takes, e.g. None)."""
    if not (isinstance(value, str) and value in allowed):
        raise ValueError(f"{name}={shown(value)} is not one of {tuple(allowed)}{also}")
    return value


def check_callable(name: str, value, takes: str = "", allow_none: bool = True):
    """A function to call back (`takes` says with what), or None where allow_none: refused where it
    is passed, not when it is first called, deep inside a run."""
    if callable(value) or (value is None and allow_none):
        return value
    allowed = "a callable" + (f" taking {takes}" if takes else "") + (", or None" if allow_none else "")
    raise ValueError(f"{name}={shown(value)} is {a_type(value)}; allowed: {allowed}")


def check_path(name: str, value, allow_none: bool = False):
    """A file's path: a str or an os.PathLike (pathlib.Path), or None where allow_none; never a number
    or bytes (whether the file is there and readable is paths.py's to tell)."""
    if isinstance(value, (str, os.PathLike)) or (value is None and allow_none):
        return value
    allowed = "a path, as a str or a pathlib.Path" + (", or None" if allow_none else "")
    raise ValueError(f"{name}={shown(value)} is {a_type(value)}; allowed: {allowed}")


# ----- keywords: a call names only the parameters its function has ---------------------------------------
def check_keywords(where: str, given: dict, allowed, listed: str = "") -> None:
    """ValueError naming every keyword of `given` (name -> value) that `where` does not take, and
    listing those it does (`listed`, where they need more words than their names); Python's own
    TypeError names one and not what is allowed."""
    unknown = [name for name in given if name not in allowed]
    if unknown:  # the first few named: a caller may unpack any dict
        named = ", ".join(f"{name}={shown(given[name])}" for name in unknown[:5])
        named += f", and {len(unknown) - 5:,} more" if len(unknown) > 5 else ""
        plural = "s" if len(unknown) > 1 else ""
        raise ValueError(
            f"unknown keyword{plural} {named} for {where}; allowed: {listed or ', '.join(allowed)}"
        )


def keywords_of(function) -> tuple[str, ...]:
    """The parameters `function` takes by keyword (a method's self or cls left out), in order."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(function).parameters.values()
    return tuple(p.name for p in parameters if p.kind in kinds and p.name not in ("self", "cls"))


def known_keywords(function):
    """`function` (or a class: its __init__) answering an unknown keyword with check_keywords'
    ValueError. Its signature, as help() shows it, is unchanged."""
    if isinstance(function, type):
        function.__init__ = known_keywords(function.__init__)
        return function
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(function).parameters.values()):
        raise TypeError(f"{function.__qualname__} takes **keywords: it checks their names itself")
    allowed = keywords_of(function)
    taken = frozenset(allowed)
    where = function.__qualname__.removesuffix(".__init__")

    @functools.wraps(function)
    def checked(*args, **kwargs):
        if not taken.issuperset(kwargs):
            check_keywords(where, kwargs, allowed)
        return function(*args, **kwargs)

    return checked


def check_seed(name: str, value, num_streams: int = 1, allow_none: bool = False) -> int | None:
    """A seed for torch.Generator; a caller that seeds num_streams generators with seed, seed + 1,
    ... (a pool's devices, a workload's requests) keeps the last one in range too."""
    meaning = "a seed for torch.Generator" + (
        f"; {num_streams} streams use seed + 0..{num_streams - 1}" if num_streams > 1 else ""
    )
    return check_int(name, value, 0, MAX_SEED - (num_streams - 1), meaning, allow_none)


def check_block_size(value, name: str = "block_size") -> int:
    """Tokens per block: a power of two (a GPU kernel then splits a slot into block and offset with a
    shift and a mask, and the memory benchmark's sweeps go 1, 2, 4, ...), at most MAX_BLOCK_SIZE."""
    allowed = f"a power of two in [1, {MAX_BLOCK_SIZE}] (1, 2, 4, ..., {MAX_BLOCK_SIZE})"
    if not is_integer(value):
        raise ValueError(f"{name}={shown(value)} is {a_type(value)}; allowed: {allowed}")
    if not 1 <= value <= MAX_BLOCK_SIZE or value & (value - 1):
        raise ValueError(f"{name}={shown(value)} is not allowed; allowed: {allowed}")
    return int(value)


def check_blocks_per_device(value, name: str = "blocks_per_device") -> list[int]:
    """Blocks per device as D >= 1 Python ints, each >= 1 (a device with no block could hold no row of
    its experts), MAX_BLOCKS at most in all; ValueError naming the first bad entry."""
    allowed = (
        "a list or tuple of D integers >= 1 (Python or numpy ints), or a 1-D integer tensor or numpy "
        "array of them"
    )
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if not integer_dtype(value.dtype):
            raise ValueError(
                f"{name}={preview(value)} has dtype {value.dtype}; allowed: {allowed}, never rounded"
            )
        if value.ndim != 1:
            raise ValueError(f"{name} has shape {tuple(value.shape)}; allowed: {allowed}")
        values = value.tolist()
    elif isinstance(value, (list, tuple)):
        values = list(value)
    else:
        raise ValueError(f"{name}={shown(value)} is {a_type(value)}; allowed: {allowed}")
    if not values:
        raise ValueError(f"{name}={shown(value)} is empty; allowed: {allowed} (D >= 1)")
    counts = [
        check_int(f"{name}[{d}]", n, 1, MAX_BLOCKS, f"the blocks of device {d}") for d, n in enumerate(values)
    ]
    if sum(counts) > MAX_BLOCKS:
        raise ValueError(
            f"{name} sums to {sum(counts):,} blocks; allowed: at most {number(MAX_BLOCKS)} in all "
            "(block tables are int32)"
        )
    return counts


def check_device_table(
    value,
    num_devices: int,
    num_layers: int | None = None,
    num_experts: int | None = None,
    name: str = "device_of_expert",
    every_layer: bool = False,
    devices_meaning: str = "one per entry of blocks_per_device",
) -> torch.Tensor:
    """The device of every expert of every layer, as an (L, E) int64 tensor with entries in [0, D),
    D = num_devices; ValueError naming the first bad value (nothing is rounded or read as digits).
    num_layers and num_experts None: any (L, E) with L, E >= 1, read from the table; every_layer:
    an (E,) table is given for every layer."""
    devices = f"0..{num_devices - 1}"
    if num_layers is None or num_experts is None:
        shapes = "(L, E) with L, E >= 1"
    elif every_layer:
        shapes = f"(E,) = ({num_experts},) or (L, E) = ({num_layers}, {num_experts})"
    else:
        shapes = f"(L, E) = ({num_layers}, {num_experts})"
    allowed = (
        f"devices {devices} as an integer tensor or numpy array, or (nested) lists of ints, of shape {shapes}"
    )
    if isinstance(value, (list, tuple)):
        for where, entry in entries(value):
            if not is_integer(entry):
                raise ValueError(f"{name}{where}={shown(entry)} is {a_type(entry)}; allowed: {allowed}")
        try:
            table = torch.tensor(value, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as error:  # ragged lists, or an int past int64
            raise ValueError(
                f"{name} is not a rectangular table of int64 ({error}); allowed: {allowed}"
            ) from None
    elif isinstance(value, (torch.Tensor, np.ndarray)):
        if not integer_dtype(value.dtype):
            raise ValueError(f"{_first_value(name, value)} has dtype {value.dtype}; allowed: {allowed}")
        table = torch.as_tensor(value).to(torch.int64)
    else:
        raise ValueError(f"{name}={shown(value)} is {a_type(value)}; allowed: {allowed}")
    if every_layer and table.dim() == 1 and num_layers is not None:
        table = table.expand(num_layers, -1)
    if num_layers is None or num_experts is None:
        right = table.dim() == 2 and table.numel() > 0
    else:
        right = tuple(table.shape) == (num_layers, num_experts)
    if not right:
        raise ValueError(f"{name} must be {shapes}; got {tuple(table.shape)}")
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= num_devices):
        named = sorted(set(table.reshape(-1).tolist()))
        meaning = f" ({devices_meaning})" if devices_meaning else ""
        raise ValueError(f"{name} names devices {shown(named)}; allowed: {devices}{meaning}")
    return table.contiguous()


def _first_value(name: str, table) -> str:
    """`name[i]=v` for the first entry of `table` that is not a whole number (else the first)."""
    try:
        flat = torch.as_tensor(table).reshape(-1)
    except TypeError:  # a numpy array of text or objects
        return name
    if flat.numel() == 0:
        return f"{name}=[]"
    i = int((flat != flat.round()).int().argmax()) if flat.is_floating_point() else 0
    index = ", ".join(str(int(k)) for k in np.unravel_index(i, tuple(table.shape)))
    return f"{name}[{index}]={preview(flat[i : i + 1])[1:-1]}"


# ----- ids: many integers at once, as a tensor ---------------------------------------------------------
def preview(values) -> str:
    """The first values as a user would write them (1.7, not 1.7000000476837158; 3.0, not 3)."""
    flat = values.reshape(-1)
    shown_values = [repr(float(f"{v:.6g}")) if isinstance(v, float) else repr(v) for v in flat[:4].tolist()]
    return "[" + ", ".join(shown_values) + (", ...]" if len(flat) > 4 else "]")


def integer_dtype(dtype) -> bool:
    """Whether a torch or numpy dtype holds integers (bool is not one)."""
    if isinstance(dtype, torch.dtype):
        return not (dtype == torch.bool or dtype.is_floating_point or dtype.is_complex)
    return dtype.kind in "iu"


def entries(values, where=""):
    """(where, value) for each entry of (nested) lists, where = "[i][j]..."."""
    for i, v in enumerate(values):
        if isinstance(v, (list, tuple)):
            yield from entries(v, f"{where}[{i}]")
        else:
            yield f"{where}[{i}]", v


def check_ids(ids, name: str = "block_ids") -> torch.Tensor:
    """`ids` as an int64 tensor of the same shape, or ValueError naming the first non-integer (text
    is never read as digits); empty input of any dtype is allowed. Ranges are the caller's."""
    if type(ids) is torch.Tensor and ids.dtype == torch.int64:  # already ids: most calls, at once
        return ids
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name}={shown(ids)} is text ({type(ids).__name__}); allowed: {IDS_ALLOWED}")
    if isinstance(ids, (list, tuple)):
        for where, v in entries(ids):
            if not (is_integer(v) or isinstance(v, torch.Tensor)):
                raise ValueError(f"{name}{where}={shown(v)} is {a_type(v)}; allowed: {IDS_ALLOWED}")
    try:
        tensor = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"{name} of type {type(ids).__name__} are not integer ids ({error}); allowed: {IDS_ALLOWED}"
        ) from None
    if tensor.numel() and not integer_dtype(tensor.dtype):
        raise ValueError(
            f"{name}={preview(tensor)} has dtype {tensor.dtype}; allowed: "
            f"{IDS_ALLOWED}, never rounded or read as 0/1"
        )
    return tensor.to(torch.int64)


# ----- memory: a size no machine here could hold is refused before it is asked for ----------------------
def memory_of(device) -> int | None:
    """Bytes of memory `device` has (the machine's, for the CPU), or None where it cannot be told."""
    device = torch.device(device)
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError, AssertionError):
        return None  # no sysconf (Windows), or no such GPU: the allocation itself will tell
    return None


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.1f} GiB"


def check_fits_memory(what: str, num_bytes: int, device="cpu", hint: str = "") -> None:
    """ValueError, before anything is allocated, when `what` takes more bytes than `device` has."""
    total = memory_of(device)
    if total is not None and num_bytes > total:
        device = torch.device(device)
        owner = "this machine's" if device.type == "cpu" else f"{device}'s"
        raise ValueError(
            f"{what} would take {gib(num_bytes)} ({num_bytes:,} bytes); allowed: at most {owner} "
            f"{gib(total)} of memory" + (f": {hint}" if hint else "")
        )
