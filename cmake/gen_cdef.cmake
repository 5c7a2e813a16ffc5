# Turns core/include/gdp.h into lua/gdp/cdef.lua: preprocess with GDP_CDEF defined
# (no system headers, no extern "C"), drop blank lines, wrap as a Lua long string.
# Usage: cmake -DCC=cc -DHEADER=gdp.h -DOUT=cdef.lua -P gen_cdef.cmake
execute_process(
  COMMAND ${CC} -E -P -DGDP_CDEF -x c ${HEADER}
  OUTPUT_VARIABLE decls
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "preprocessing ${HEADER} failed")
endif()
string(REGEX REPLACE "\n[ \t]*\n+" "\n" decls "${decls}")
get_filename_component(dir ${OUT} DIRECTORY)
file(MAKE_DIRECTORY ${dir})
file(WRITE ${OUT}.tmp "-- Generated from core/include/gdp.h by cmake/gen_cdef.cmake. Do not edit.\nreturn [==[\n${decls}]==]\n")
file(RENAME ${OUT}.tmp ${OUT})
