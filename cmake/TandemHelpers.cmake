# Helpers shared by every folder's CMakeLists.txt.
#
# Layering (docs/architecture.md, "Folders and libraries" and "Dependency rules"): each folder is
# one library whose public include directory exposes that folder alone, as "<folder>/<header>". A
# target sees another folder's headers only if it links that folder's library, so an include
# across a forbidden edge fails to compile (tests/layering checks the rules).

set(TANDEM_INCLUDE_ROOT ${CMAKE_BINARY_DIR}/include_roots)

# Flags every tandem target gets (kept on targets, never global).
function(tandem_target_flags target)
  target_compile_options(${target} PRIVATE
    # Params structs are filled with designated initializers that leave defaulted fields out on
    # purpose, which -Wextra's missing-field-initializers would flag.
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wno-unused-parameter -Wno-missing-field-initializers>
    $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo --expt-relaxed-constexpr -Xcompiler=-Wall>)
  if(TANDEM_WERROR)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-Werror> $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
  endif()
  if(TANDEM_FUZZ)
    # Coverage for libFuzzer in every library the fuzz targets reach (tests/fuzz/, clang only).
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=fuzzer-no-link>)
  endif()
  if(TANDEM_SANITIZE)
    string(REPLACE ";" "," _san "${TANDEM_SANITIZE}")
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${_san} -fno-omit-frame-pointer>)
    target_link_options(${target} PRIVATE -fsanitize=${_san})
  endif()
endfunction()

# tandem_folder_library(<folder> SOURCES ... DEPS ...)
# Creates library tandem_<folder> whose public include root exposes only "<folder>/...".
function(tandem_folder_library folder)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  set(root ${TANDEM_INCLUDE_ROOT}/${folder})
  file(MAKE_DIRECTORY ${root})
  if(NOT EXISTS ${root}/${folder})
    file(CREATE_LINK ${CMAKE_SOURCE_DIR}/${folder} ${root}/${folder} SYMBOLIC)
  endif()
  add_library(tandem_${folder} ${ARG_SOURCES})
  target_include_directories(tandem_${folder} PUBLIC ${root})
  target_link_libraries(tandem_${folder} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  tandem_target_flags(tandem_${folder})
endfunction()

# tandem_add_test(<name> SOURCES ... DEPS ... [LABELS ...] [TIMEOUT s])
# One gtest binary, registered with ctest (every binary is registered; nothing drops out).
function(tandem_add_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  if(NOT TARGET tandem_gtest_main)
    # gtest's main, except that a run where every test skipped exits 77 (tests/gtest_main.cc).
    add_library(tandem_gtest_main STATIC ${CMAKE_SOURCE_DIR}/tests/gtest_main.cc)
    target_link_libraries(tandem_gtest_main PUBLIC GTest::gmock GTest::gtest tandem_bootstrap)
    tandem_target_flags(tandem_gtest_main)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gmock GTest::gtest tandem_gtest_main)
  target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/tests)  # shared test helpers
  tandem_target_flags(${name})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  add_test(NAME ${name} COMMAND ${name} --gtest_color=no)
  set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} SKIP_RETURN_CODE 77
    ENVIRONMENT "TANDEM_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
  if(ARG_LABELS)
    set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABELS}")
  endif()
endfunction()
