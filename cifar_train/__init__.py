"""The CIFAR-10 training app: a user of jaxmp's public API.

``python train.py --config configs/<name>.py --workdir DIR`` runs
`loop.train_and_evaluate`. The modules, one idea each:

* `settings`: the config, validated and resolved once into `Settings`.
* `data_sources`: tfds builders (CIFAR, image folders, the synthetic set).
* `host_stream`: the tf.data training stream and the padded eval batches.
* `device_data`: the same augmentation for a data set kept on the devices.
* `batches`: one batch-source interface over both data modes.
* `steps`: train state, model and optimizer factories, train and eval steps.
* `mesh`: devices, processes and global arrays.
* `checkpoint`, `reporting`: orbax checkpoints; metrics, plots, TensorBoard.
* `loop`: the whole job. `cli`: one-line errors for the command line.

This package needs the ``app`` extra: ``pip install -e '.[app]'``.
"""
