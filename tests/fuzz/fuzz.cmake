# Initial cache for scripts/fuzz.sh's build (cmake -C): Debian's clang-14, every project source
# compiled with libFuzzer's coverage instrumentation and ASan+UBSan (the fuzz targets link the
# libFuzzer driver, see tests/fuzz/CMakeLists.txt). gRPC, protobuf and Abseil are Debian's
# uninstrumented shared libraries: the fuzzers see coverage of hsbn's own code only.
set(CMAKE_C_COMPILER clang-14 CACHE STRING "")
set(CMAKE_CXX_COMPILER clang++-14 CACHE STRING "")
set(CMAKE_BUILD_TYPE RelWithDebInfo CACHE STRING "")
set(HSBN_CUDA OFF CACHE STRING "")
set(HSBN_FUZZ ON CACHE BOOL "")
set(_san "-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer")
set(CMAKE_C_FLAGS "${_san}" CACHE STRING "")
set(CMAKE_CXX_FLAGS "${_san}" CACHE STRING "")
set(CMAKE_EXE_LINKER_FLAGS "-fsanitize=address,undefined" CACHE STRING "")
set(CMAKE_SHARED_LINKER_FLAGS "-fsanitize=address,undefined" CACHE STRING "")
