"""``python -m mfsdp.examples`` (under torchrun): the quickstart."""

from mfsdp.examples.quickstart import main

main()
