"""The CIFAR-10 training app: a user of jaxmp's public API.

``python train.py --config configs/<name>.py --workdir DIR`` runs
`loop.train_and_evaluate`. The modules, one idea each:

* `settings`: the config, validated and resolved once into `Settings`.
* `data_sources`: tfds builders prepared to ArrayRecord, read into numpy
  (`cifar`, `image_folder`, `synthetic`; `png` codes their images;
  ``python -m cifar_train.prepare`` prepares one ahead).
* `host_stream`: the batch of a step, in numpy, and the padded eval batches.
* `device_data`: the same batch, built on the devices, bit for bit.
* `batches`: one batch-source interface over both data modes.
* `steps`: train state, model and optimizer factories, train and eval steps.
* `mesh`: devices, processes and global arrays.
* `checkpoint`, `reporting`: orbax checkpoints; metrics, plots, TensorBoard.
* `loop`: the whole job. `cli`: one-line errors for the command line.

This package needs the ``app`` extra: ``pip install -e '.[app]'``.
"""
