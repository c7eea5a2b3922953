import sys

from jax_gin._trace import main

sys.exit(main())
