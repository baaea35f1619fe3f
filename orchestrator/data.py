"""The task samples: a `datasets.Dataset` from a file, a factory or the hub, drawn in seeded epochs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protocols.config import DataConfig
from protocols.errors import UserError, describe
from protocols.imports import import_object


class DataError(UserError, ValueError):
    """The task data could not be loaded or is empty."""

_FILE_KINDS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_samples(config: DataConfig, key: str = "data") -> list[dict[str, Any]]:
    """The samples of a data section (`key` names it in errors: `data` or `eval.data`)."""
    import datasets

    key += ".path" if config.path is not None else ".factory" if config.factory is not None else ".hub"
    try:
        if config.path is not None and Path(config.path).is_dir():  # written by Dataset(Dict).save_to_disk
            dataset = datasets.load_from_disk(config.path)
            if isinstance(dataset, datasets.DatasetDict):
                if config.split not in dataset:
                    raise DataError(f"{config.path!r} has splits {', '.join(dataset)}, not {config.split!r}; "
                                    "set data.split")
                dataset = dataset[config.split]
        elif config.path is not None:
            kind = _FILE_KINDS.get(Path(config.path).suffix)
            if kind is None:
                raise DataError(f"{config.path!r} must end in one of {', '.join(_FILE_KINDS)}, or be a directory "
                                "written by save_to_disk")
            dataset = datasets.load_dataset(kind, data_files=config.path, split="train")
        elif config.factory is not None:
            dataset = import_object(config.factory)(**config.kwargs)
        else:
            dataset = datasets.load_dataset(config.hub, split=config.split, **config.kwargs)
        rows = dataset.to_list() if hasattr(dataset, "to_list") else list(dataset)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"{key}: loading the data raised {describe(exc)}; "
                        "check the data source") from exc
    if not rows:
        raise DataError(f"{key}: the dataset is empty; give it at least one sample")
    return rows


@dataclass
class DataPosition:
    epoch: int = 0
    index: int = 0


def next_batch(rows: list[dict[str, Any]], size: int, position: DataPosition, seed: int,
               shuffle: bool) -> list[dict[str, Any]]:
    """`size` samples from a seeded per-epoch order, advancing `position` (in place) across epochs. The next
    epoch starts when a sample of it is taken, not when the last one of the epoch before is."""
    batch = []
    while len(batch) < size:
        if position.index == len(rows):
            position.epoch, position.index = position.epoch + 1, 0
        order = np.random.default_rng([seed, position.epoch]).permutation(len(rows)) if shuffle else range(len(rows))
        take = min(size - len(batch), len(rows) - position.index)
        batch += [rows[int(i)] for i in order[position.index:position.index + take]]
        position.index += take
    return batch
