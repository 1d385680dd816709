"""Typical wrong answers to the exercises of lecture 01 (see tests/wrong_answers/__init__.py)."""

STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
ZERO = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}


# --- bytes_per_param(optimizer, precision) -------------------------------------------------

def _no_master(optimizer, precision):  # the "14 + 14 + 56 GB" count
    s = STATES[optimizer]
    if precision == "fp32":
        return 8 + 4 * s
    return 4 + (2 if precision == "bf16" else 4) * s


def _half_precision_states(optimizer, precision):
    s = STATES[optimizer]
    if precision == "fp32":
        return 8 + 4 * s
    return 2 + 2 + 2 * s + (4 if precision.endswith("mixed") else 0)


def _master_in_pure_bf16(optimizer, precision):
    s = STATES[optimizer]
    return 8 + 4 * s if precision == "fp32" else 2 + 2 + 4 + 4 * s


def _adam_one_state(optimizer, precision):
    s = {"sgd": 0, "sgd-momentum": 1, "adam": 1, "adamw": 1}[optimizer]
    per = {"fp32": (8, 4), "bf16": (4, 2)}.get(precision, (8, 4))
    return per[0] + per[1] * s


def _as_float(optimizer, precision):
    s = STATES[optimizer]
    return float({"fp32": 8 + 4 * s, "bf16": 4 + 2 * s}.get(precision, 8 + 4 * s))


# --- zero_bytes_per_device(n_params, zero_stage, world_size) -----------------------------

def _zero(table):
    def bytes_per_device(n_params, zero_stage, world_size):
        a, b = table[zero_stage]
        return a * n_params + b * n_params // world_size
    return bytes_per_device


_everything_sharded = _zero({0: (0, 16), 1: (0, 16), 2: (0, 16), 3: (0, 16)})
_stage1_keeps_master = _zero({0: (16, 0), 1: (8, 8), 2: (2, 14), 3: (0, 16)})
_stage2_keeps_grads = _zero({0: (16, 0), 1: (4, 12), 2: (4, 12), 3: (0, 16)})
_k_is_8 = _zero({0: (12, 0), 1: (4, 8), 2: (2, 10), 3: (0, 12)})


def _zero_float(n_params, zero_stage, world_size):
    a, b = ZERO[zero_stage]
    return a * n_params + b * n_params / world_size


# --- largest_model(capacity_bytes, optimizer, precision) ---------------------------------

def _recipe_bytes(optimizer, precision):
    s = STATES[optimizer]
    return {"fp32": 8 + 4 * s, "bf16": 4 + 2 * s}.get(precision, 8 + 4 * s)


def _rounds_up(capacity_bytes, optimizer, precision):
    return -(-capacity_bytes // _recipe_bytes(optimizer, precision))


def _float_division(capacity_bytes, optimizer, precision):
    return capacity_bytes / _recipe_bytes(optimizer, precision)


def _weights_only(capacity_bytes, optimizer, precision):
    return capacity_bytes // (4 if precision == "fp32" else 2)


def _largest_without_master(capacity_bytes, optimizer, precision):
    return capacity_bytes // _no_master(optimizer, precision)


def _capacity_in_whole_gb(capacity_bytes, optimizer, precision):  # "an 80 GB card"
    return capacity_bytes // 10**9 * 10**9 // _recipe_bytes(optimizer, precision)


def _capacity_in_whole_gib(capacity_bytes, optimizer, precision):  # nvidia-smi's round figure
    return -(-capacity_bytes // 2**30) * 2**30 // _recipe_bytes(optimizer, precision)


# --- gpus_needed(n_params, capacity_bytes, zero_stage) -----------------------------------

def _all_stages_shard_everything(n_params, capacity_bytes, zero_stage):
    return max(1, -(-16 * n_params // capacity_bytes))


def _no_floor_check(n_params, capacity_bytes, zero_stage):
    a, b = ZERO[zero_stage]
    if b == 0:
        return 1
    return max(1, -(-b * n_params // (capacity_bytes - a * n_params)))


def _rounds_down(n_params, capacity_bytes, zero_stage):
    a, b = ZERO[zero_stage]
    room = capacity_bytes - a * n_params
    if b == 0:
        return 1 if room >= 0 else None
    return None if room <= 0 else max(1, b * n_params // room)


def _strict_inequality(n_params, capacity_bytes, zero_stage):
    a, b = ZERO[zero_stage]
    room = capacity_bytes - a * n_params
    if b == 0:
        return 1 if room > 0 else None
    return None if room <= 0 else max(1, b * n_params // room + 1)


def _gpus_forget_master(n_params, capacity_bytes, zero_stage):
    a, b = {0: (12, 0), 1: (4, 8), 2: (2, 10), 3: (0, 12)}[zero_stage]
    room = capacity_bytes - a * n_params
    if b == 0:
        return 1 if room >= 0 else None
    return None if room <= 0 else max(1, -(-b * n_params // room))


WRONG = {
    "check_bytes_per_param": [
        ("forgets the fp32 master weights of the mixed recipes", {"bytes_per_param": _no_master}),
        ("keeps Adam's m and v in 16 bits in the mixed recipes",
         {"bytes_per_param": _half_precision_states}),
        ("gives pure bf16 an fp32 master copy", {"bytes_per_param": _master_in_pure_bf16}),
        ("counts one state tensor for Adam", {"bytes_per_param": _adam_one_state}),
        ("returns a float", {"bytes_per_param": _as_float}),
    ],
    "check_zero_bytes_per_device": [
        ("divides everything by N at every stage", {"zero_bytes_per_device": _everything_sharded}),
        ("stage 1 shards m and v but keeps the master weights whole",
         {"zero_bytes_per_device": _stage1_keeps_master}),
        ("stage 2 forgets to shard the gradients", {"zero_bytes_per_device": _stage2_keeps_grads}),
        ("K = 8: forgets the fp32 master weights", {"zero_bytes_per_device": _k_is_8}),
        ("float division", {"zero_bytes_per_device": _zero_float}),
    ],
    "check_largest_model": [
        ("rounds the parameter count up", {"largest_model": _rounds_up}),
        ("returns a float", {"largest_model": _float_division}),
        ("counts only the weights", {"largest_model": _weights_only}),
        ("forgets the master weights", {"largest_model": _largest_without_master}),
        ("rounds the capacity down to whole GB, as cards are named",
         {"largest_model": _capacity_in_whole_gb}),
        ("rounds the capacity up to whole GiB, as nvidia-smi shows it",
         {"largest_model": _capacity_in_whole_gib}),
    ],
    "check_gpus_needed": [
        ("treats every stage as fully sharded", {"gpus_needed": _all_stages_shard_everything}),
        ("never answers None when the unsharded part is too big",
         {"gpus_needed": _no_floor_check}),
        ("rounds the number of GPUs down", {"gpus_needed": _rounds_down}),
        ("a model that fits exactly is said not to fit", {"gpus_needed": _strict_inequality}),
        ("forgets the master weights (K = 8)", {"gpus_needed": _gpus_forget_master}),
    ],
}
