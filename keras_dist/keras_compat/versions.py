"""Which Keras keras_dist drives, and the one error for a Keras it cannot.

keras_dist decides what to do with the installed Keras by what it has (see
the other modules of `keras_compat`), never by its version number. The version
is read only to refuse a Keras older than the oldest one supported, and to say
in the error which Keras was found and which range is supported.
"""

from __future__ import annotations

import re
import warnings

import keras

#: The Keras releases keras_dist supports (pyproject.toml's `keras` range).
SUPPORTED_RANGE = ">=3.15,<3.17"
MINIMUM = (3, 15)
#: The newest minor release the test suite ran on (keras-nightly's 3.16 dev
#: build, `constraints/keras-nightly.txt`).
NEWEST_TESTED = (3, 16)
TESTED = "3.15.1 and keras-nightly 3.16.0.dev2026102704"


class UnsupportedKerasError(ImportError):
    """The installed Keras is one keras_dist cannot drive."""


def keras_version() -> tuple[int, int]:
    """`(major, minor)` of the installed Keras (`3.16.0.dev2026102704`: 3, 16)."""
    match = re.match(r"(\d+)\.(\d+)", keras.__version__)
    if match is None:
        return (0, 0)
    return int(match.group(1)), int(match.group(2))


def unsupported(missing: str) -> UnsupportedKerasError:
    """The error for a Keras keras_dist cannot drive, `missing` saying why."""
    from keras_dist._version import __version__  # noqa: PLC0415

    return UnsupportedKerasError(
        f"keras_dist {__version__} cannot drive Keras {keras.__version__}: "
        f"{missing}. keras_dist supports keras{SUPPORTED_RANGE} (tested: "
        f"{TESTED}); install one, e.g. pip install 'keras{SUPPORTED_RANGE}'."
    )


def require_supported_keras() -> None:
    """Refuse a Keras older than `MINIMUM`; warn once about one newer than any
    the suite ran on (it works if what keras_dist needs is where it looks,
    which the rest of `keras_compat` checks as it loads).

    Raises:
        UnsupportedKerasError: naming the Keras found and the supported range.
    """
    version = keras_version()
    if version < MINIMUM:
        raise unsupported(
            f"it needs Keras {MINIMUM[0]}.{MINIMUM[1]} or newer (the trainer, "
            "data adapter and distribution internals keras_dist builds on)"
        )
    if version > NEWEST_TESTED:
        warnings.warn(
            f"keras_dist was tested with Keras {TESTED}; Keras "
            f"{keras.__version__} is newer. It loads because what keras_dist "
            "needs is where it looks; the test suite has not run on it.",
            UserWarning,
            stacklevel=2,
        )
