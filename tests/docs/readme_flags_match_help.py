"""README.md's flag block must be exactly `hsbn-aggregator --help` from "Flags:" on."""
import pathlib
import subprocess
import sys

aggregator, readme = sys.argv[1], pathlib.Path(sys.argv[2]).read_text()
help_text = subprocess.run([aggregator, "--help"], capture_output=True, text=True,
                           check=True).stdout
flags = help_text[help_text.index("Flags:"):].rstrip()
if flags not in readme:
    sys.exit("README.md's flag block differs from `hsbn-aggregator --help`; paste the --help "
             "text from 'Flags:' on into README.md")
print("README.md's flag block matches --help")
