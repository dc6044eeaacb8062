"""``python -m pagedllm.native``: see doctor.py."""
import sys

from pagedllm.native.doctor import main

sys.exit(main())
