"""Which source lines are the user's: the first frame outside the libraries.

jax's own heuristic stops at the first frame outside jax, which for a Flax
or Equinox model is the layer's ``__call__`` (``flax/.../linear.py``), not
the user's line that called the layer.
"""

import os
import sys

# Frames of these packages are not the user's line.
_LIBRARIES = ("jaxmp", "optax", "flax", "equinox", "jax", "jaxlib")


def _library_dirs() -> tuple[str, ...]:
  dirs = []
  for name in _LIBRARIES:
    mod = sys.modules.get(name)
    path = getattr(mod, "__file__", None)
    if path:
      dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
  return tuple(dirs)


def first_user_frame(frames):
  """The first of ``frames`` (innermost first, with ``file_name``) outside them."""
  dirs = _library_dirs()
  for frame in frames:
    if not os.path.abspath(frame.file_name).startswith(dirs):
      return frame
  return None


def user_stacklevel() -> int:
  """The ``stacklevel`` of the first caller frame outside the libraries."""
  frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
  dirs = _library_dirs()
  while frame.f_back is not None and os.path.abspath(
    frame.f_code.co_filename
  ).startswith(dirs):
    frame, level = frame.f_back, level + 1
  return level
