"""Which torch is running, the releases remat supports, and the words of torch's errors remat recognizes.

The package imports this module first: an unsupported release is refused, naming the supported range,
before the other modules import torch's private names, which such a release may lack. The text of
torch's errors is no API either, and changes between releases as the names do.
"""

from __future__ import annotations

import torch

__all__ = [
    "DATA_NOT_ALLOCATED",
    "LEAF_UPDATED_IN_PLACE",
    "RELEASE",
    "RELEASE_NUMBERS",
    "SUPPORTED",
    "UNTRACEABLE_COLLECTIVE",
    "check_supported",
    "is_saved_value_modified",
    "minor_release",
]


# The minor releases remat is tested on (the floor in pyproject.toml, the newest on the registry).
SUPPORTED = ("2.10", "2.11", "2.12", "2.13", "2.14", "2.15")


def minor_release(version: str) -> str:
    """The minor release of a torch version: "2.11" for "2.11.0+cu130"."""
    return ".".join(version.split("+")[0].split(".")[:2])


RELEASE = minor_release(torch.__version__)  # of the running torch; `_quirks.Quirk.applies` takes it


def check_supported(version: str = torch.__version__) -> None:
    """Refuse to import on a torch release outside the tested range, saying which releases are."""
    if minor_release(version) not in SUPPORTED:
        raise ImportError(
            f"remat supports torch {SUPPORTED[0]} to {SUPPORTED[-1]} (each minor release tested), but torch "
            f"{version} is installed. Install a supported release, e.g. `pip install torch=={SUPPORTED[-1]}.*`."
        )


check_supported()  # before the package's other modules, whose private imports an unsupported release may lack


RELEASE_NUMBERS = tuple(map(int, RELEASE.split(".")))  # the running release, to compare


# --- torch's error messages ------------------------------------------------------------------------------------

LEAF_UPDATED_IN_PLACE = "leaf Variable that requires grad is being used in an in-place operation"
UNTRACEABLE_COLLECTIVE = ("Could not find a token for effect", "c10d")
# What a kernel that reads a fake tensor's values (`tensor_split` with tensor indices) raises.
DATA_NOT_ALLOCATED = "data is not allocated yet"


def is_saved_value_modified(error: RuntimeError) -> bool:
    """Whether autograd raised `error` because a value a gradient formula saved was updated in place since."""
    return "modified by an inplace operation" in str(error)
