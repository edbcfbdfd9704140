module @jit_s1_bwd_mb3 attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg3: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg4: tensor<16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg5: tensor<16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg6: tensor<16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}, %arg7: tensor<16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<4x16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<16x16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<16xf32> {jax.result_info = "result[2]", sdy.sharding = #sdy.sharding<@mesh, [{}]>}) {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<4x16xf32>
    %1 = stablehlo.multiply %0, %arg2 : tensor<4x16xf32>
    %2 = stablehlo.add %0, %1 : tensor<4x16xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %3 = stablehlo.reduce(%2 init: %cst) applies stablehlo.add across dimensions = [0] : (tensor<4x16xf32>, tensor<f32>) -> tensor<16xf32>
    %4 = stablehlo.reshape %3 : (tensor<16xf32>) -> tensor<1x16xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %5 = stablehlo.reduce(%4 init: %cst_0) applies stablehlo.add across dimensions = [0] : (tensor<1x16xf32>, tensor<f32>) -> tensor<16xf32>
    %6 = stablehlo.dot_general %2, %arg3, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x16xf32>, tensor<4x16xf32>) -> tensor<16x16xf32>
    %7 = stablehlo.transpose %6, dims = [1, 0] : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %8 = stablehlo.dot_general %2, %arg4, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<4x16xf32>, tensor<16x16xf32>) -> tensor<4x16xf32>
    %9 = stablehlo.add %arg5, %7 : tensor<16x16xf32>
    %cst_1 = stablehlo.constant dense<4.000000e+00> : tensor<f32>
    %10 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<16x16xf32>
    %11 = stablehlo.divide %9, %10 : tensor<16x16xf32>
    %12 = stablehlo.add %arg6, %5 : tensor<16xf32>
    %cst_2 = stablehlo.constant dense<4.000000e+00> : tensor<f32>
    %13 = stablehlo.broadcast_in_dim %cst_2, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %14 = stablehlo.divide %12, %13 : tensor<16xf32>
    %cst_3 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %15 = stablehlo.broadcast_in_dim %cst_3, dims = [] : (tensor<f32>) -> tensor<16x16xf32>
    %16 = stablehlo.multiply %15, %11 : tensor<16x16xf32>
    %17 = stablehlo.subtract %arg4, %16 : tensor<16x16xf32>
    %cst_4 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %18 = stablehlo.broadcast_in_dim %cst_4, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %19 = stablehlo.multiply %18, %14 : tensor<16xf32>
    %20 = stablehlo.subtract %arg7, %19 : tensor<16xf32>
    return %8, %17, %20 : tensor<4x16xf32>, tensor<16x16xf32>, tensor<16xf32>
  }
}
