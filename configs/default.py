"""Default config: ResNet18 on CIFAR10 in float16 (Apex O2) with dynamic loss scaling.

Run:

    python train.py --config configs/default.py --workdir /tmp/cifar10_o2

Recipe: kuangliu/pytorch-cifar (github.com/kuangliu/pytorch-cifar, README and
main.py): CIFAR-style ResNet18, SGD lr 0.1, momentum 0.9, weight decay 5e-4,
batch 128, cosine annealing over 200 epochs, random crop (pad 4) + horizontal
flip, per-channel CIFAR10 normalisation. It reports 95.44% test accuracy for
ResNet18; this config should reach >= 94% on a GPU. Not measured on a GPU from
this repository yet (see docs/performance.md).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default (main job) configuration."""
  config = ml_collections.ConfigDict()

  # Model.
  config.model = (
    "resnet18"  # "resnet18" (CIFAR stem) or "resnet18_torchvision".
  )
  config.num_filters = 64
  # Start (fine-tune) from PyTorch weights: a .safetensors, .npz or .pth/.pt
  # state dict with torchvision's names ("resnet18_torchvision") or
  # kuangliu/pytorch-cifar's ("resnet18"). A checkpoint in the workdir wins.
  config.init_from = ""

  # Precision: an Apex-style preset (O0, O1, O2, O3, bf16, bf16-kahan,
  # bf16-stochastic) or a jmp policy string such as
  # "params=float32,compute=float16,output=float32".
  config.policy = "O2"
  # How half-precision params keep their updates: "" (the preset's), "fp32"
  # (fp32 masters), "kahan", "stochastic" (no fp32 copy), "remainder" (the
  # exact fp32 master in 2 bytes: bfloat16 params only, as bf16-kahan and
  # bf16-stochastic have) or "none".
  config.master_weights = ""
  # How the optimizer's momentum is stored between steps: "" or "fp32" (4
  # bytes an element), "bf16" (2) or "int8" (1, and an fp32 scale per block
  # of 256); each step decodes it, updates in fp32 and encodes it again.
  # Leaves under optimizer_state_min_size elements (BatchNorm, biases) stay
  # fp32. jaxmp.StateQuantization.
  config.optimizer_state = ""
  config.optimizer_state_min_size = 4096
  # How the weight gradients are summed across devices: "fp32" (the sums in
  # fp32), "half_wire" (half precision on the wire, fp32 adds: half the
  # bytes) or "native" (XLA's choice: the sums in the half dtype).
  config.grad_reduce = "fp32"
  # Dynamic loss scaling (used when the preset asks for it). The initial
  # scale is a number, or "auto": calibrated on the first batch with
  # jaxmp.calibrate_loss_scale (O1/O2 only; a resumed run keeps its scale).
  config.init_loss_scale = ml_collections.FieldReference(
    2.0**15, field_type=object
  )
  config.loss_scale_period = 2000
  config.loss_scale_factor = 2
  config.min_loss_scale = 1.0
  config.max_loss_scale = 2.0**24
  config.loss_scale_hysteresis = 1
  # Stop with an error when the scale sits at its floor for this many skipped
  # steps in a row.
  config.max_consecutive_skips = 100
  # Stop with an error after this many steps in a row whose loss itself was
  # NaN/inf (bad data, divergence). Those steps are skipped without backing
  # off the loss scale.
  config.max_nonfinite_loss_steps = 10
  # Spike skipping (jaxmp.SpikeSkip): drop a step whose loss or gradient norm
  # exceeds mean + factor * std of the last `window` accepted steps. 0: off.
  # (OLMo and MaxText use a window of 128 and a factor of 6.)
  config.spike_skip_window = 0
  config.spike_skip_factor = 6.0
  # Keep jaxmp's per-leaf gradient report: a log step that saw skipped steps
  # names the leaf with the most non-finite gradient elements. Under O1 also
  # autocast's debug mode: a warning names the first op whose fp16 output
  # overflowed in the forward pass.
  config.diagnostics = False
  # Every N-th applied step, measure what each layer's half dtype alone
  # loses of its update (jaxmp.rounding_report; 0 = off): steps.jsonl gets
  # the figures at log steps, the log the final report, the workdir
  # rounding_stalled.png (docs/guides/master_weights.md).
  config.rounding_every = 0

  # Data.
  config.dataset = "cifar10"  # cifar10, cifar100, image_folder, synthetic.
  config.data_dir = ""  # tfds data_dir ("" = tfds default); image_folder root.
  config.mean = (0.4914, 0.4822, 0.4465)
  config.std = (0.2470, 0.2435, 0.2616)
  config.augment = True  # Random crop (pad 4) + horizontal flip.
  # Where the training split lives: True (on the devices: shuffling, crops,
  # flips and normalisation run there, in jitted programs), False (built on the
  # host, a background thread placing each batch on the devices ahead of its
  # step), or "auto": on the devices when the uint8 split, padded, fits in
  # a quarter of one device's memory (on a CPU, of the host's RAM), else on
  # the host. The test split follows the same rule.
  config.data_on_device = ml_collections.FieldReference(
    "auto", field_type=object
  )
  config.synthetic_train_examples = 10_000
  config.synthetic_test_examples = 2_000

  # Optimisation.
  config.batch_size = 128
  config.eval_batch_size = 500
  # Train steps per jitted call: one program loops over up to k steps (its
  # step count a runtime value, so that every call size runs the same code,
  # bit for bit; k = 1 is the lone step, no loop), for steps too short to hide the host's
  # dispatch (small models, small batches on a GPU). "auto": 1 on a CPU;
  # elsewhere the largest k <= 8 that divides the steps of an epoch,
  # log_every_steps and checkpoint_every_steps (when set). A call never runs
  # past a log step, a save or the epoch's end.
  config.steps_per_call = ml_collections.FieldReference(
    "auto", field_type=object
  )
  config.num_epochs = 200
  config.num_train_steps = -1  # > 0: stop after this many steps, then evaluate.
  config.learning_rate = 0.1
  config.lr_schedule = "cosine"  # "cosine" or "constant".
  config.warmup_epochs = 0.0
  config.momentum = 0.9
  config.nesterov = False
  config.weight_decay = 5e-4
  config.label_smoothing = 0.0

  # Devices: 0 = every visible device (a 1-D data-parallel mesh).
  config.num_devices = 0
  # Several hosts: set all three, or start under SLURM/Open MPI (auto-detect).
  config.coordinator_address = ""  # e.g. "10.0.0.1:1234"
  config.num_processes = 1
  config.process_id = 0
  # A process that sends no heartbeat for this long is dead: every other
  # process then exits with an error that names it, instead of waiting in a
  # collective for ever.
  config.distributed_heartbeat_timeout_s = 30

  # Bookkeeping.
  config.seed = 0
  config.log_every_steps = 50
  config.checkpoint_every_steps = 0  # 0: at the end of every epoch.
  config.keep_checkpoints = 3
  config.progress_bar = True
  # JAX's persistent compilation cache, so that a second run starts warm:
  # "auto" = $XDG_CACHE_HOME/jaxmp/jit (~/.cache/jaxmp/jit), a path, or ""
  # for off. A cache directory set through JAX itself
  # (JAX_COMPILATION_CACHE_DIR) takes precedence.
  config.compile_cache_dir = "auto"
  # CPU only: glibc keeps freed memory for the next step instead of
  # unmapping it (cifar_train/startup.py). Saves ~0.3-0.4 s of page faults a
  # step for the CIFAR-stem ResNet18 at batch 128 on 2 cores; costs ~3 s of
  # start-up with the host-stream input pipeline. Ignored on GPU and TPU.
  config.reuse_host_memory = False

  # Test and demo knobs (docs/guides/diagnostics.md); 0 = off. Step K is
  # the one logged as "Step K".
  config.inject_nan_data_at_step = 0  # NaN images from step K on.
  config.inject_overflow_at_step = 0  # At step K only, one leaf's gradient
  config.inject_overflow_leaf = "layer3_1/conv2/kernel"  # becomes all +inf.
  return config
