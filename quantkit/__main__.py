"""`python -m quantkit` (and `torchrun -m quantkit quantize ...`): the command line."""
from quantkit.cli import main

if __name__ == "__main__":
    main()
