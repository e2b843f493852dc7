"""`python -m geminicompress` (and `accelerate launch -m geminicompress ...`) run the CLI."""

from geminicompress.cli import main

if __name__ == "__main__":
    main()
