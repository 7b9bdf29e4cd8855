# Initial cache for scripts/sanitize.sh's ASan+UBSan build (cmake -C): Debian's clang-14, every
# project source instrumented, the first UBSan finding fatal. gRPC, protobuf and Abseil are
# Debian's shared libraries, built with GCC and not instrumented.
set(CMAKE_C_COMPILER clang-14 CACHE STRING "")
set(CMAKE_CXX_COMPILER clang++-14 CACHE STRING "")
set(CMAKE_BUILD_TYPE RelWithDebInfo CACHE STRING "")
set(HSBN_CUDA OFF CACHE STRING "")
set(_san "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer")
set(CMAKE_C_FLAGS "${_san}" CACHE STRING "")
set(CMAKE_CXX_FLAGS "${_san}" CACHE STRING "")
set(CMAKE_EXE_LINKER_FLAGS "-fsanitize=address,undefined" CACHE STRING "")
set(CMAKE_SHARED_LINKER_FLAGS "-fsanitize=address,undefined" CACHE STRING "")
