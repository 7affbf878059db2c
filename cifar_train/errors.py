"""The app's user-error class: the command line prints these in one line."""


class UserError(Exception):
  """Something the user can fix: a config value, a path, a missing data set.

  The command line turns exactly these into ``error: <message>`` and exit
  code 2; any other exception is a bug and keeps its traceback.
  """


class ConfigError(UserError, ValueError):
  """A config value is invalid; the message names it and the valid choices."""


class DatasetUnavailableError(UserError, RuntimeError):
  """The data set is not prepared locally and cannot be downloaded."""


class CheckpointError(UserError, RuntimeError):
  """No usable checkpoint, or one that does not fit the config."""


class WorkdirError(UserError, PermissionError):
  """The workdir cannot be written."""


class TrainingError(UserError, RuntimeError):
  """Training cannot go on: the loss itself is NaN/inf or the scale collapsed."""


class Preempted(Exception):
  """The run stopped at ``step`` on SIGTERM or SIGINT, after a checkpoint.

  Not an error: the command line exits 0, and the same command resumes.
  """

  def __init__(self, step: int):
    super().__init__(f"preempted at step {step}: checkpoint saved")
    self.step = step
