""":func:`load`: a checkpoint folder or a ``.gguf`` file as a :class:`~portable_llm.models.Model`.

The keyword arguments of :func:`load` are written here once; every reader takes them as one
:class:`~portable_llm.checkpoint.build.LoadOptions` and returns a
:class:`~portable_llm.checkpoint.build.CheckpointContents`, which
:func:`~portable_llm.checkpoint.build.build_model` turns into the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from portable_llm.checkpoint.build import CheckpointContents, LoadOptions, build_model
from portable_llm.checkpoint.folder import read_folder
from portable_llm.checkpoint.gguf import read_gguf
from portable_llm.checkpoint.hub import resolve_checkpoint
from portable_llm.checkpoint.partitioned import read_partitioned
from portable_llm.decoder.model import Model
from portable_llm.partition.engine import engine_for

__all__ = ["load", "read_checkpoint"]


# Over 80 lines for its docstring (every format, option and error a user meets at load); the
# code is a dozen lines handing the options to the readers.
def load(
    path: str | Path,
    /,
    *,
    backend: str = "numpy",
    dtype: Any = None,
    device: Any = None,
    dequantize: bool | str = "auto",
    revision: str | None = None,
    gguf_file: str | None = None,
    tensor_parallel: Any = None,
    pipeline_parallel: Any = None,
    activations: str = "auto",
    compile: bool | str = "auto",
) -> Model:
    """Load a checkpoint folder (``config.json``, ``model.safetensors``, ``tokenizer.json``) or a
    ``.gguf`` file.

    Parameters
    ----------
    path : str or Path
        A ``.gguf`` file, a Hub repository id (``"org/name"``, read from the local Hugging Face
        cache, never downloaded: :mod:`portable_llm.checkpoint.hub`), or a local folder as
        ``save_pretrained`` writes it (or a Hub snapshot): ``config.json``,
        ``model.safetensors`` or ``model.safetensors.index.json`` with its shards; optionally
        ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` and
        ``generation_config.json``. Every file must lie inside the folder (a Hub snapshot's
        symlinks into its repository's ``blobs/`` excepted).
    backend : str
        The array library to run on (``"numpy"``, ``"torch"``, ``"mlx"``, ``"jax"``,
        ``"array_api_strict"``).
    dtype : str or dtype, optional
        The float dtype of the weights and activations; default: the checkpoint's own (that of
        ``model.embed_tokens.weight``). Tensors stored in another dtype are cast.
    device : str or device, optional
        Where the weights go: ``"cpu"``, ``"gpu"``, ``"cuda:0"``, ``"mps"``, ``"device1"``
        (array-api-strict) or the library's own device object; default: the backend's default
        device. Each tensor is read on the host and moved there at once; the model's inputs
        follow its weights.
    dequantize : bool or "auto"
        A ``.gguf`` file (:mod:`portable_llm.checkpoint.gguf`): every weight as floats in
        ``dtype`` (transformers' reading) rather than kept quantized where the block type is
        exactly MLX's affine format. ``"auto"`` (the default; a ``.gguf`` file or an mlx-lm
        quantized folder): kept quantized only where the codes decode at least as fast as the
        floats on this backend, device and dtype
        (:func:`~portable_llm.ops.quant.keeps_codes`, measured; docs/ops/quantization.md), so
        a quantized file never decodes slower than its floats; ``False`` keeps the codes
        everywhere, for the memory saving.
    revision, gguf_file : str, optional
        For a Hub repository id (``"org/name"``): the branch, tag or commit, and the ``.gguf``
        file of a GGUF repository.
    tensor_parallel, pipeline_parallel : the backend's group, optional
        Split the model over a group (see :doc:`partition`): on JAX a ``jax.sharding.Mesh``
        with one axis or ``(mesh, axis_name)`` (both at once: one 2-D mesh with axes ``"pp"``
        and ``"tp"`` passed to both); on torch a ``torch.distributed`` process group or 1-D
        ``DeviceMesh``; on MLX an ``mx.distributed.Group``. Each rank reads only the tensors
        and slices it holds; quantized weights (an mlx-lm folder's, a ``.gguf`` file's) stay
        quantized as ``dequantize`` says, each rank holding whole groups.

    activations : {"auto", "float", "int8"}
        What a quantized projection multiplies its codes by (docs/gguf.md, "8-bit
        activations"). ``"float"``: the activations as they are (the exact product of the
        dequantized weights). ``"int8"``: each projection's input rounded to 8-bit blocks of 32
        first, as llama.cpp's Q8 blocks, and multiplied in integers
        (:mod:`portable_llm.ops.quant.int8`): judged by KL divergence on real text
        (:func:`~portable_llm.perplexity`); ``dequantize="auto"`` then keeps every code, and
        the model must have a quantized projection. ``"auto"`` (default): ``"int8"`` for a
        quantized checkpoint where it was measured faster with a KL divergence no worse than
        llama.cpp's (:data:`~portable_llm.ops.quant.policy.INT8_BY_DEFAULT`), else ``"float"``.
        The model's :attr:`~portable_llm.models.Model.activations` says which ran; float
        weights are multiplied as they are in either mode.
    compile : {"auto", True, False}
        The compiled decode step (:attr:`~portable_llm.models.Model.compiled`, docs/models.md,
        "Speed"): ``"auto"`` (default) where it is on by default (JAX, MLX); ``True`` also on
        torch's CPU (``make_fx`` and inductor: a C++ compiler at run time, and a compilation
        per cache capacity; without a compiler the prepared forward runs and
        :attr:`~portable_llm.models.Model.compile_note` says why); ``False``: none.

    Returns
    -------
    Model

    Raises
    ------
    FileNotFoundError
        No ``config.json``, or no weights file (or a shard the index names).
    ValueError
        A dtype the backend lacks (on ``device``), or a device it does not have; a group
        that does not split the model (heads, KV heads or intermediate sizes not divisible by
        its size, a mesh without the named axis), before any weight is read. ``activations``
        not one of the three; ``"int8"`` with ``dequantize=True``, with a partitioned model,
        or on a model with no quantized projection.
    portable_llm.models.CheckpointError
        (a ``ValueError``) Anything wrong with the folder's files, named in the message: a
        malformed JSON file, safetensors file or ``tokenizer.json``; a path out of the folder;
        a config value of the wrong type or range, an unsupported ``model_type`` or rope type
        (the message lists the supported ones), more layers or experts than the weights hold;
        tensors missing, unexpected, of the wrong shape or not float (all of them listed).
    """
    options = LoadOptions(
        backend=backend,
        dtype=dtype,
        device=device,
        dequantize=dequantize,
        revision=revision,
        gguf_file=gguf_file,
        activations=activations,
        compile=compile,
    )
    if tensor_parallel is not None or pipeline_parallel is not None:
        engine = engine_for(options.backend, tensor_parallel, pipeline_parallel)
        path = resolve_checkpoint(path, revision=revision, gguf_file=gguf_file)
        return read_partitioned(path, options.reading(partitioned=True), engine)[0]
    return build_model(read_checkpoint(path, options.reading()), options)


def read_checkpoint(path: str | Path, options: LoadOptions | None = None, /) -> CheckpointContents:
    """What :func:`load` builds its model from: a folder read by
    :func:`~portable_llm.checkpoint.folder.read_folder`, a ``.gguf`` file by
    :func:`~portable_llm.checkpoint.gguf.read_gguf`, a Hub repository id resolved in the local
    cache first (:func:`~portable_llm.checkpoint.hub.resolve_checkpoint`, with ``options``'
    ``revision`` and ``gguf_file``). ``options``: default ``LoadOptions()``."""
    options = LoadOptions() if options is None else options
    source = resolve_checkpoint(path, revision=options.revision, gguf_file=options.gguf_file)
    if source.suffix == ".gguf" and not source.is_dir():
        return read_gguf(source, options)
    return read_folder(source, options)
