module @jit_s0_bwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<8xi32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}, %arg1: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg3: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg4: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg5: tensor<16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg6: tensor<32x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<16x16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<32x16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %0 = stablehlo.broadcast_in_dim %arg0, dims = [0] : (tensor<8xi32>) -> tensor<8x1xi32>
    %1 = stablehlo.multiply %arg1, %arg2 : tensor<8x16xf32>
    %2 = stablehlo.multiply %1, %arg3 : tensor<8x16xf32>
    %3 = stablehlo.add %1, %2 : tensor<8x16xf32>
    %4 = stablehlo.dot_general %3, %arg4, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<16x16xf32>
    %5 = stablehlo.transpose %4, dims = [1, 0] : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %6 = stablehlo.dot_general %3, %arg5, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %7 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<32x16xf32>
    %8 = "stablehlo.scatter"(%7, %0, %6) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [1], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, unique_indices = false}> ({
    ^bb0(%arg7: tensor<f32>, %arg8: tensor<f32>):
      %10 = stablehlo.add %arg7, %arg8 : tensor<f32>
      stablehlo.return %10 : tensor<f32>
    }) : (tensor<32x16xf32>, tensor<8x1xi32>, tensor<8x16xf32>) -> tensor<32x16xf32>
    %9 = stablehlo.add %arg6, %8 : tensor<32x16xf32>
    return %5, %9 : tensor<16x16xf32>, tensor<32x16xf32>
  }
}
