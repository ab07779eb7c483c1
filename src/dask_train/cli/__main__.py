"""``python -m dask_train.cli``: the ``dask-train`` command."""

import sys

from dask_train.cli.main import main

sys.exit(main())
