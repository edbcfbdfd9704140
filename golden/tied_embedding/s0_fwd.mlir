module @jit_s0_fwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<8xi32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}, %arg1: tensor<32x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<8xi32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}]>}, tensor<8x16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<8x16xf32> {jax.result_info = "result[2]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<8x16xf32> {jax.result_info = "result[3]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<16x32xf32> {jax.result_info = "result[4]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %0 = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<i32>) -> tensor<8xi32>
    %1 = stablehlo.compare LT, %arg0, %0, SIGNED : (tensor<8xi32>, tensor<8xi32>) -> tensor<8xi1>
    %c_0 = stablehlo.constant dense<32> : tensor<i32>
    %2 = stablehlo.broadcast_in_dim %c_0, dims = [] : (tensor<i32>) -> tensor<8xi32>
    %3 = stablehlo.add %arg0, %2 : tensor<8xi32>
    %4 = stablehlo.select %1, %3, %arg0 : tensor<8xi1>, tensor<8xi32>
    %5 = stablehlo.broadcast_in_dim %4, dims = [0] : (tensor<8xi32>) -> tensor<8x1xi32>
    %6 = "stablehlo.gather"(%arg1, %5) <{dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = array<i64: 1, 16>}> : (tensor<32x16xf32>, tensor<8x1xi32>) -> tensor<8x16xf32>
    %7 = stablehlo.dot_general %6, %arg2, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
    %8 = stablehlo.tanh %7 : tensor<8x16xf32>
    %cst = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %9 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %10 = stablehlo.subtract %9, %8 : tensor<8x16xf32>
    %11 = stablehlo.transpose %arg1, dims = [1, 0] : (tensor<32x16xf32>) -> tensor<16x32xf32>
    return %4, %6, %8, %10, %11 : tensor<8xi32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>, tensor<16x32xf32>
  }
}
