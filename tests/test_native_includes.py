"""Every native source names the standard header of each std:: facility it uses, itself or
through a header of this repository that it includes. A standard header that another one
happens to include differs between standard libraries: gcc 12's <thread> brings in
<system_error> and the GPU machine's gcc 13 does not, so a missing include builds here and
breaks there (and for users of other compilers). The check is textual (comments and strings
left out) over the facilities in HEADERS; it does not replace a build with a second compiler."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("csrc", "cuda", "include")
SUFFIXES = (".cc", ".h", ".cu", ".cuh")

# header -> the std:: names that the standard declares in it (those a source here may use)
HEADERS = {
    "algorithm": ["sort", "min", "max", "find", "find_if", "fill", "fill_n", "copy", "copy_n",
                  "reverse", "any_of", "all_of", "none_of", "count", "count_if", "clamp",
                  "max_element", "min_element", "unique", "lower_bound", "upper_bound"],
    "array": ["array"],
    "atomic": ["atomic", "atomic_thread_fence", "memory_order_relaxed", "memory_order_acquire",
               "memory_order_release", "memory_order_seq_cst"],
    "chrono": ["chrono"],
    "cmath": ["sqrt", "isnan", "isinf", "isfinite", "fabs", "ldexp", "ceil", "floor"],
    "condition_variable": ["condition_variable"],
    "cstdint": ["uint64_t", "int64_t", "uint32_t", "int32_t", "uint16_t", "int16_t",
                "uint8_t", "int8_t", "uintptr_t"],
    "cstdio": ["printf", "fprintf", "snprintf", "fflush", "fopen", "fclose", "fputs"],
    "cstdlib": ["getenv", "abort", "exit", "strtol", "strtoll", "strtod", "atoi", "_Exit"],
    "cstring": ["memcpy", "memset", "memcmp", "memmove", "strlen", "strerror", "strcmp",
                "strncmp"],
    "deque": ["deque"],
    "exception": ["exception_ptr", "current_exception", "rethrow_exception", "terminate",
                  "uncaught_exceptions"],
    "functional": ["function", "hash"],
    "future": ["future", "promise", "async"],
    "iostream": ["cout", "cerr"],
    "limits": ["numeric_limits"],
    "map": ["map", "multimap"],
    "memory": ["unique_ptr", "shared_ptr", "weak_ptr", "make_unique", "make_shared"],
    "mutex": ["mutex", "recursive_mutex", "lock_guard", "unique_lock", "scoped_lock",
              "once_flag", "call_once"],
    "new": ["nothrow", "bad_alloc"],
    "numeric": ["accumulate", "iota", "gcd", "lcm"],
    "optional": ["optional", "nullopt"],
    "set": ["set", "multiset"],
    "shared_mutex": ["shared_mutex", "shared_lock"],
    "sstream": ["ostringstream", "stringstream", "istringstream"],
    "stdexcept": ["runtime_error", "invalid_argument", "out_of_range", "logic_error",
                  "overflow_error", "length_error", "domain_error", "range_error"],
    "string": ["string", "to_string", "stoi", "stol", "stoll", "stoul", "stoull", "stod"],
    "string_view": ["string_view"],
    "system_error": ["system_error", "error_code", "errc", "generic_category",
                     "system_category"],
    "thread": ["thread", "this_thread"],
    "tuple": ["tuple", "tie", "make_tuple", "tuple_size"],
    "type_traits": ["is_same", "is_same_v", "enable_if", "enable_if_t", "conditional",
                    "conditional_t", "is_integral", "is_integral_v", "is_floating_point",
                    "is_floating_point_v", "decay_t", "remove_cv_t", "underlying_type_t"],
    "unordered_map": ["unordered_map"],
    "unordered_set": ["unordered_set"],
    "utility": ["pair", "make_pair", "move", "swap", "exchange", "forward", "index_sequence",
                "make_index_sequence"],
    "variant": ["variant", "visit", "holds_alternative"],
    "vector": ["vector"],
}
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
# std::name, not std::name_more or std::chrono::name (the latter counted as std::chrono)
_USE = {h: re.compile(r"\bstd::(" + "|".join(map(re.escape, names)) + r")\b")
        for h, names in HEADERS.items()}


def _code(text: str) -> str:
    """The text without comments and string literals."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def _sources(root: pathlib.Path) -> list:
    return sorted(p for d in SOURCE_DIRS if (root / d).is_dir()
                  for p in (root / d).rglob("*") if p.suffix in SUFFIXES)


def _includes(path: pathlib.Path, root: pathlib.Path, seen: set) -> set:
    """The headers that `path` includes which are not this repository's, directly or through
    the repository's headers that it includes."""
    out = set()
    for name in _INCLUDE.findall(_code_keep_includes(path.read_text())):
        here = [path.parent] + [root / d for d in SOURCE_DIRS]
        found = next((d / name for d in here if (d / name).is_file()), None)
        if found is None:
            out.add(name)
        elif found not in seen:
            seen.add(found)
            out |= _includes(found, root, seen)
    return out


def _code_keep_includes(text: str) -> str:
    """The text without comments (an include inside one does not count)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def missing_includes(root: pathlib.Path) -> list:
    """'file: std::x needs <h>' for each use of a facility in HEADERS whose header the file
    does not include."""
    out = []
    for path in _sources(root):
        have = _includes(path, root, {path})
        code = _code(path.read_text())
        for header, use in _USE.items():
            if header in have:
                continue
            names = sorted(set(use.findall(code)))
            if names:
                out.append(f"{path.relative_to(root)}: std::{', std::'.join(names)} "
                           f"needs <{header}>")
    return out


def test_native_sources_include_what_they_use():
    assert _sources(ROOT), "no native sources found"
    assert missing_includes(ROOT) == []


def test_the_check_finds_a_missing_include(tmp_path):
    """The check itself: a use without its header is found, one through a repository header
    is not, and comments and strings do not count."""
    (tmp_path / "include").mkdir()
    (tmp_path / "csrc").mkdir()
    (tmp_path / "include" / "a.h").write_text("#include <vector>\n")
    (tmp_path / "csrc" / "b.cc").write_text(
        '#include "a.h"\n#include <thread>\n'
        "void f() { std::vector<int> v; std::thread t; }\n"
        "void g() { try {} catch (const std::system_error& e) {} }\n"
        "// std::map in a comment\nconst char* s = \"std::optional\";\n")
    assert missing_includes(tmp_path) == ["csrc/b.cc: std::system_error needs <system_error>"]
    (tmp_path / "csrc" / "b.cc").write_text("// #include <vector>\nstd::vector<int> v;\n")
    assert missing_includes(tmp_path) == ["csrc/b.cc: std::vector needs <vector>"]
