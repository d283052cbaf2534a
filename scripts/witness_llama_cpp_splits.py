"""Second witness for the GGUF pre-tokenizers: llama.cpp's own regex splitter against Hugging Face's.

llama.cpp pre-tokenizes with `unicode_regex_split` (src/unicode.cpp, self-contained with
unicode-data.cpp) over the expressions `llama-vocab.cpp` lists per `tokenizer.ggml.pre`; our GGUF
tokenizer rebuilds the same expressions as Hugging Face `Split` pre-tokenizers. This compiles a
20-line driver against llama.cpp's two unicode files (a local source tree, e.g. the `vendor/llama.cpp`
of the llama-cpp-python 0.3.36 sdist; nothing is downloaded), splits the same text both ways and
prints where the pieces differ. Not a test: it needs a C++ compiler and llama.cpp's source.

    python scripts/witness_llama_cpp_splits.py /path/to/llama.cpp [--pre spark2_5] [--text FILE]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenizers import Regex, pre_tokenizers

from mlx_dspark.loading.gguf_tokenizer import PRE_TOKENIZERS

DRIVER = r"""
#include "unicode.h"
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>
// argv[1]: text file; argv[2..]: the split expressions, in order. Prints each piece as hex bytes.
int main(int argc, char ** argv) {
    std::ifstream in(argv[1], std::ios::binary);
    std::stringstream ss; ss << in.rdbuf();
    std::vector<std::string> exprs(argv + 2, argv + argc);
    for (const auto & piece : unicode_regex_split(ss.str(), exprs, false)) {
        for (unsigned char c : piece) std::printf("%02x", c);
        std::printf("\n");
    }
    return 0;
}
"""

# llama-vocab.cpp's own spelling where it differs from the tokenizer.json one (std::regex has no (?i:))
LLAMA_CPP_EXPRS = {
    "qwen2": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "qwen35": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}

DEFAULT_TEXT = (
    "1234567890 12 123 1234 3.14159 ٣٤٥ ⅧⅨ 2026-12-01T20:23:35Z 0x7fff 1e-9\n"
    "日本語のテキスト、カタカナとひらがな。中文汉字混合English单词和123数字。龥龦 〜ー\n"
    "!!!??? ...... ------====== \\\\\\\\ \\n\\t ''' ``` \"\"\" (((x))) {[<>]} a+b*c/d%e\n"
    "def f(x):\r\n\treturn {'k': [x, x**2]}  # comment\r\n\r\n\n\n   \t  \n"
    "Ünïcödé ñ é (e\u0301) Straße Ελληνικά русский עברית العربية हिन्दी\n"
    "   leading and trailing   \n\n\n  \r\r\n x\u3000y\u00a0z 🙂👍🏽 'll 's 'RE\n"
)


def llama_cpp_pieces(source: Path, text: str, exprs: tuple[str, ...], work: Path) -> list[str]:
    binary = work / "split"
    if not binary.exists():
        (work / "driver.cpp").write_text(DRIVER, encoding="utf-8")
        src = source / "src"
        subprocess.run(
            ["g++", "-O1", "-std=c++17", f"-I{src}", str(work / "driver.cpp"), str(src / "unicode.cpp"),
             str(src / "unicode-data.cpp"), "-o", str(binary)],
            check=True,
        )  # fmt: skip
    (work / "text.txt").write_bytes(text.encode("utf-8"))
    out = subprocess.run([str(binary), str(work / "text.txt"), *exprs], check=True, capture_output=True, text=True).stdout
    return [bytes.fromhex(line).decode("utf-8", errors="replace") for line in out.splitlines()]


def hf_pieces(text: str, exprs: tuple[str, ...]) -> list[str]:
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(e), behavior="isolated", invert=False) for e in exprs])
    return [piece for piece, _ in pre.pre_tokenize_str(text)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("llama_cpp", type=Path, help="a llama.cpp source tree (with src/unicode.cpp)")
    parser.add_argument("--pre", default="spark2_5", choices=["spark2_5", *LLAMA_CPP_EXPRS])
    parser.add_argument("--text", type=Path, help="a UTF-8 text file (default: a built-in mixed sample)")
    parser.add_argument("--build-dir", type=Path, help="keep the compiled driver here (default: a temporary directory)")
    args = parser.parse_args()
    text = args.text.read_bytes().decode("utf-8") if args.text else DEFAULT_TEXT  # CR LF kept as written
    exprs = PRE_TOKENIZERS[args.pre][0]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.build_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        theirs = llama_cpp_pieces(args.llama_cpp, text, LLAMA_CPP_EXPRS.get(args.pre, exprs), work)
        ours = hf_pieces(text, exprs)
    print(f"{args.pre}: {len(text)} characters, {len(ours)} Hugging Face pieces, {len(theirs)} llama.cpp pieces")
    if ours == theirs:
        print("identical splits")
        return 0
    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    print(f"first difference at piece {i}: Hugging Face {ours[max(0, i - 2) : i + 4]!r}")
    print(f"{'':>30}llama.cpp    {theirs[max(0, i - 2) : i + 4]!r}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
