"""``train.py`` with the one-block ResNet in place of ResNet18 (bench smoke).

The same arguments as ``train.py``. The model is the ResNet of the config
with one stage of one block (``stage_sizes=(1,)``, as the tests' one-block
net): every kind of layer at a fraction of ResNet18's compile time, so that
``bash bench/gpu.sh --smoke`` runs the app's job on a CPU in seconds.
"""

import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from cifar_train import steps  # pylint: disable=g-import-not-at-top,wrong-import-position

_create_model = steps.create_model


def _one_block(*args, **kwargs):
  return _create_model(*args, **kwargs).clone(stage_sizes=(1,))


steps.create_model = _one_block
sys.argv[0] = os.path.join(REPO, "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
