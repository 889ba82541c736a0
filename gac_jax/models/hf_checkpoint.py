"""Hugging Face checkpoint import and export for Qwen3 and Llama decoders.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards
listed in `model.safetensors.index.json`. Import reads one tensor at a time, converts it
to this package's layout (e.g. `q_proj.weight` [N*H, D] -> `q_dnh` [D, N, H]) and places
it directly on its `NamedSharding` (each device receives only its slice). Export writes
the same format back, so `transformers` loads it with `from_pretrained`. Needs the
`safetensors` package. `config.json` is translated by `gac_jax.models.hf_config`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh

from gac_jax._closing import Closing
from gac_jax.models.config import DTYPES, ModelConfig
from gac_jax.models.decoder import Decoder
from gac_jax.models.hf_config import (
    CONFIG_FILE,
    config_from_hf,
    config_to_hf,
    read_hf_config,
    read_json_object,
)
from gac_jax.models.sharding import ShardingRules, host_array, state_shardings

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Tensors some checkpoints carry that hold no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _safetensors():
    try:
        import safetensors.numpy  # Optional dependency, loaded on use.
        from safetensors import safe_open
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Hugging Face checkpoint import/export needs the `safetensors` package "
            "(pip install safetensors)."
        ) from error
    return safetensors.numpy, safe_open


class TensorMapping(NamedTuple):
    """How one parameter is stored in a Hugging Face checkpoint: a layer's parameter
    (stacked here, [L, ...]) as one tensor per layer, its name a template of the index."""

    path: tuple  # The parameter's path in `nnx.state(decoder)`, e.g. ("layers", "attn", ...).
    hf_name: str  # The safetensors key, e.g. "model.layers.{}.self_attn.q_proj.weight".
    to_ours: Callable[[np.ndarray], np.ndarray]  # HF layout -> this package's (one layer).
    to_hf: Callable[[np.ndarray], np.ndarray]  # This package's layout -> HF layout.

    def hf_names(self, num_layers: int) -> list[str]:
        """The tensors' names: one, or one per layer (`per_layer`)."""
        return (
            [self.hf_name.format(i) for i in range(num_layers)]
            if self.per_layer
            else [self.hf_name]
        )

    @property
    def per_layer(self) -> bool:
        return "{}" in self.hf_name


def _same(path, hf_name) -> TensorMapping:
    return TensorMapping(path, hf_name, lambda x: x, lambda x: x)


def _linear(path, hf_name, in_shape, out_shape) -> TensorMapping:
    """An `nn.Linear` weight, stored [out, in], kept here as [*in_shape, *out_shape]."""
    return TensorMapping(
        path,
        hf_name,
        lambda w: np.reshape(w.T, (*in_shape, *out_shape)),
        lambda x: np.ascontiguousarray(np.reshape(x, (math.prod(in_shape), -1)).T),
    )


def parameter_mapping(config: ModelConfig) -> list[TensorMapping]:
    """Every parameter's state path, its HF tensor name and the two layout conversions."""
    d, n, k, h = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
    f, v = config.mlp_dim, config.vocab_size
    mapping = [
        _same(("embedding_vd",), "model.embed_tokens.weight"),
        _same(("final_norm", "scale"), "model.norm.weight"),
    ]
    if not config.tie_word_embeddings:
        mapping.append(_linear(("lm_head_dv",), "lm_head.weight", (d,), (v,)))
    hf, attn, mlp = "model.layers.{}.", ("layers", "attn"), ("layers", "mlp")
    mapping += [
        _same(("layers", "attn_norm", "scale"), hf + "input_layernorm.weight"),
        _same(("layers", "mlp_norm", "scale"), hf + "post_attention_layernorm.weight"),
        _linear((*attn, "q_dnh"), hf + "self_attn.q_proj.weight", (d,), (n, h)),
        _linear((*attn, "k_dkh"), hf + "self_attn.k_proj.weight", (d,), (k, h)),
        _linear((*attn, "v_dkh"), hf + "self_attn.v_proj.weight", (d,), (k, h)),
        _linear((*attn, "o_nhd"), hf + "self_attn.o_proj.weight", (n, h), (d,)),
        _linear((*mlp, "gate_df"), hf + "mlp.gate_proj.weight", (d,), (f,)),
        _linear((*mlp, "up_df"), hf + "mlp.up_proj.weight", (d,), (f,)),
        _linear((*mlp, "down_fd"), hf + "mlp.down_proj.weight", (f,), (d,)),
    ]
    if config.qk_norm:
        mapping += [
            _same((*attn, "q_norm", "scale"), hf + "self_attn.q_norm.weight"),
            _same((*attn, "k_norm", "scale"), hf + "self_attn.k_norm.weight"),
        ]
    return mapping


def _weight_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it."""
    index_path = path / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{str(index_path)!r} has no weight_map object.")
        return _indexed_files(path, weight_map)
    single = path / SINGLE_FILE
    if single.is_file():
        with _TensorReader({}) as reader:
            return {name: single for name in reader.opened(single).keys()}
    raise FileNotFoundError(
        f"Checkpoint directory {str(path)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}."
    )


def _indexed_files(path: Path, weight_map: dict[str, Any]) -> dict[str, Path]:
    """The index's files, each checked to lie inside `path`: a checkpoint from elsewhere
    must not make the loader open files outside its directory."""
    root = path.resolve()
    files = {}
    for name, file in weight_map.items():
        resolved = (root / str(file)).resolve()
        if os.path.isabs(str(file)) or not resolved.is_relative_to(root):
            raise ValueError(
                f"{INDEX_FILE} maps {name!r} to {str(file)!r}, outside the checkpoint "
                f"directory {str(path)!r}."
            )
        files[name] = path / str(file)
    return files


@contextlib.contextmanager
def _named_errors(file: Path):
    """Re-raises the safetensors library's errors as a ValueError naming `file` (its own
    message does not say which file is corrupt)."""
    import safetensors

    try:
        yield
    except safetensors.SafetensorError as error:
        raise ValueError(
            f"Safetensors file {str(file)!r} is corrupt or truncated: {error}."
        ) from error


class _TensorReader(Closing):
    """Reads tensors by name, keeping each safetensors file open once."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._open: dict[Path, Any] = {}

    def close(self) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def opened(self, file: Path):
        if file not in self._open:
            with _named_errors(file):
                self._open[file] = _safetensors()[1](file, framework="numpy").__enter__()
        return self._open[file]

    def read(self, name: str) -> np.ndarray:
        handle = self.opened(self.files[name])
        with _named_errors(self.files[name]):
            return handle.get_tensor(name)


def _place(array: np.ndarray, sharding) -> jax.Array:
    if sharding is None:
        return jax.device_put(array)
    # Each device copies only its own slice of the host array.
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def checkpoint_dtype(hf_config: dict[str, Any]) -> str | None:
    """The dtype a checkpoint's `config.json` says its weights are stored in
    (``torch_dtype`` in transformers 4, ``dtype`` in 5), if it is one of `DTYPES`."""
    for key in ("dtype", "torch_dtype"):
        value = hf_config.get(key)
        if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
            return value.removeprefix("torch.")
    return None


def hf_model_config(path: str | os.PathLike, **config_overrides: Any) -> ModelConfig:
    """The `ModelConfig` of a checkpoint directory, computing in the checkpoint's dtype.

    The compute dtype follows `config.json`'s stored dtype, so a float32 checkpoint
    computes in float32 (the `ModelConfig` default, bfloat16, would add about 3e-3 relative
    logit error) and a bfloat16 one in bfloat16; parameters stay in `ModelConfig`'s float32
    default, which holds every stored dtype exactly. `config_overrides` (e.g.
    ``dtype="bfloat16"``, ``param_dtype="bfloat16"``) win over both.
    """
    hf_config = read_hf_config(path)
    stored = checkpoint_dtype(hf_config)
    defaults = {} if stored is None else {"dtype": stored}
    return config_from_hf(hf_config, **{**defaults, **config_overrides})


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    rules: ShardingRules | None = None,
    **config_overrides: Any,
) -> Decoder:
    """Loads a Hugging Face Qwen3 or Llama checkpoint directory (`config.json` and
    `model.safetensors`, or `model.safetensors.index.json` and shards) into a `Decoder`.

    With a `mesh`, each parameter goes straight onto its NamedSharding there (from `rules`,
    `ShardingRules()` by default): each device, or process, receives only its slices;
    otherwise onto the default device. `config_overrides` change `ModelConfig` fields (e.g.
    `param_dtype`, `remat`); without `dtype` the model computes in the checkpoint's own
    (`hf_model_config`). Parameters are cast to `param_dtype`. Raises FileNotFoundError
    without those files; ValueError (naming the file or entry) for an unsupported or
    corrupt config, a missing, misshapen or unused tensor, an index entry outside the
    directory, or a corrupt or truncated safetensors file.
    """
    path = Path(path)
    config = hf_model_config(path, **config_overrides)
    rules = ShardingRules() if rules is None else rules
    abstract = nnx.eval_shape(lambda: Decoder(config, rules, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = {}  # Parameter path -> NamedSharding; none without a mesh.
    if mesh is not None:
        shardings = _flat(state_shardings(abstract_state, mesh, rules))
    expected = _flat(abstract_state)

    files = _weight_files(path)
    mapping = parameter_mapping(config)
    used = {name for m in mapping for name in m.hf_names(config.num_layers)}
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # Tied checkpoints may still store a copy.
    unknown = sorted(n for n in files if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if unknown:
        raise ValueError(
            f"Checkpoint {str(path)!r} holds tensors a {config.family} decoder does not use: "
            f"{unknown[:8]}{' ...' if len(unknown) > 8 else ''}."
        )

    values = {}
    with _TensorReader(files) as reader:
        for m in mapping:
            target = expected[m.path]
            shape = tuple(target.shape)[m.per_layer :]
            arrays = []
            for name in m.hf_names(config.num_layers):
                if name not in files:
                    raise ValueError(f"Checkpoint {str(path)!r} has no tensor {name!r}.")
                arrays.append(_converted(reader.read(name), name, shape, m.to_ours))
            array = np.stack(arrays) if m.per_layer else arrays[0]
            values[m.path] = _place(array.astype(target.dtype, copy=False), shardings.get(m.path))
    nnx.replace_by_pure_dict(abstract_state, traverse_util.unflatten_dict(values))
    return nnx.merge(graphdef, abstract_state)


def _converted(hf_array, hf_name, shape, to_ours) -> np.ndarray:
    """One tensor in this package's layout, checked to have `shape` (one layer's)."""
    try:
        array = np.asarray(to_ours(hf_array))
    except ValueError:  # The sizes do not even reshape.
        array = None
    if array is None or array.shape != shape:
        raise ValueError(
            f"Tensor {hf_name!r} has shape {tuple(hf_array.shape)}, which does not fit the "
            f"expected parameter shape {shape} for this config."
        )
    return array


def _flat(state: nnx.State) -> dict[tuple, Any]:
    """`state`'s leaves by their paths, e.g. `("layers", "attn", "q_dnh")`."""
    return traverse_util.flatten_dict(nnx.to_pure_dict(state))


def _hf_tensors(model: Decoder, dtype) -> Iterator[tuple[str, np.ndarray]]:
    params, layers = _flat(nnx.state(model, nnx.Param)), model.config.num_layers
    for m in parameter_mapping(model.config):
        array = host_array(params[m.path])
        array = array if dtype is None else array.astype(dtype)
        for i, name in enumerate(m.hf_names(layers)):
            yield name, m.to_hf(array[i] if m.per_layer else array)


def save_hf_checkpoint(
    model: Decoder,
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 4 * 1024**3,
) -> None:
    """Writes `model` as a Hugging Face checkpoint directory (config + safetensors),
    created if needed, its checkpoint files replaced, the weights stored in `dtype` (the
    parameters' by default). Above `max_shard_bytes` the weights are split into
    `model-0000i-of-0000n.safetensors` files listed in `model.safetensors.index.json`.
    """
    if not isinstance(model, Decoder):
        raise ValueError(f"model must be a gac_jax Decoder; got {type(model).__name__}.")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} must be positive.")
    st_numpy, _ = _safetensors()
    np_dtype = None if dtype is None else jnp.dtype(dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    shards: list[dict[str, np.ndarray]] = [{}]
    shard_bytes = 0
    for name, array in _hf_tensors(model, np_dtype):
        if shards[-1] and shard_bytes + array.nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = array
        shard_bytes += array.nbytes

    for stale in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    metadata = {"format": "pt"}  # transformers refuses files without it.
    if len(shards) == 1:
        st_numpy.save_file(shards[0], str(path / SINGLE_FILE), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            st_numpy.save_file(shard, str(path / file), metadata=metadata)
            weight_map.update({name: file for name in shard})
        total = sum(array.nbytes for shard in shards for array in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
    hf_config = config_to_hf(model.config, dtype=dtype)
    (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True))
